"""What every simulated worker of a run is told: the cost model, the clock and the sizes it
needs to price its calls (a plain dataclass that travels as a dict in the worker's init)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .clock import SimClock
from .costs import CostModel


@dataclass
class SimSpec:
    model: str = "qwen2.5-7b"  # a name in costs.MODELS
    scale: float = 0.1  # wall seconds per simulated second (clock.SimClock)
    train_devices: int = 8  # the policy's data-parallel size (its gradient all-reduce)
    instances: int = 1  # rollout instances (they share the links that carry the weights)
    seed: int = 0  # the stragglers' draws (stragglers.py)
    max_running_rows: int = 64  # a rollout instance's running batch
    colocated: bool = False  # roles switch on a device: offload / onload cost time
    driver_data: bool = False  # the centralized baseline: data travels in the calls, not the TransferQueue

    @staticmethod
    def of(d: SimSpec | dict) -> SimSpec:
        return d if isinstance(d, SimSpec) else SimSpec(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def clock(self) -> SimClock:
        return SimClock(self.scale)

    @property
    def costs(self) -> CostModel:
        return CostModel.named(self.model)
