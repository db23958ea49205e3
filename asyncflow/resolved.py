"""The run's config resolved once: the checked config and every value derived from it.

The launcher loads and checks the config, builds the recipe (so that a wrong one fails before
any process starts), resolves ``model.path`` (building the tiny model once) and the platform,
then resolves the run here. The driver receives this object as it is (an argument of its
``main``, pickled into the spawned rank with the launch config); every worker receives
``to_wire()`` (a plain dict: worker calls carry JSON and tensors, never pickle) and rebuilds
it with ``from_wire``, which checks nothing and resolves nothing again. Derived values are
read from here, never recomputed where they are used.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .config import RunConfig, from_dict, to_dict
from .config.derived import offload_idle, policy_loss_name, rank_threads, rollout_dtype

WIRE_KEY = "resolved_run"  # marks the wire form (a worker may also be given a plain config dict)


@dataclass(frozen=True)
class DerivedValues:
    """What a run derives from its config and the launching node."""
    platform: str  # cpu | cuda | npu: the device kind of every rank
    offload_idle: bool  # colocated placement: the idle roles free their device memory
    rollout_dtype: str  # weight_sync.dtype with auto resolved: the rollout engine's and the synced weights' dtype
    rank_threads: int  # torch threads per rank (0: torch's default); the launching node's cores shared out
    policy_loss: str  # algorithm.policy_loss with auto resolved


@dataclass(frozen=True)
class ResolvedRun:
    """A checked config whose ``model.path`` is resolved, and its derived values. Treat
    ``config`` as read-only: it is what the launcher checked."""
    config: RunConfig
    derived: DerivedValues

    @property
    def accelerator(self) -> bool:
        return self.derived.platform != "cpu"

    def to_wire(self) -> dict[str, Any]:
        """The form a worker call carries: JSON values only."""
        return {WIRE_KEY: {"config": to_dict(self.config), "derived": asdict(self.derived)}}

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> ResolvedRun:
        """``to_wire``'s dict back as the objects, without checking or resolving anything again."""
        body = wire[WIRE_KEY]
        names = {f.name for f in fields(DerivedValues)}
        got = dict(body["derived"])
        if set(got) != names:
            raise ValueError(f"a resolved run's derived values name {sorted(got)}, expected {sorted(names)}")
        return ResolvedRun(from_dict(body["config"]), DerivedValues(**got))


def is_wire(value: Any) -> bool:
    return isinstance(value, dict) and WIRE_KEY in value


def resolve_run(cfg: RunConfig, platform: str, cpus: int | None = None) -> ResolvedRun:
    """Derive every value of a checked ``cfg`` (``model.path`` already resolved) on
    ``platform`` (cpu, cuda, npu); ``cpus``: the cores to share out (default: this process's)."""
    derived = DerivedValues(platform=platform, offload_idle=offload_idle(cfg),
                            rollout_dtype=rollout_dtype(cfg, platform != "cpu"),
                            rank_threads=rank_threads(cfg, cpus), policy_loss=policy_loss_name(cfg))
    return ResolvedRun(cfg, derived)
