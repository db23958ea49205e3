"""Simulated time: a device's work is held for its cost-model seconds times ``scale``.

``scale`` is wall seconds per simulated second (0.1: a simulated second lasts 100 ms). Only
device work is scaled; the control plane (driver, executor, TransferQueue, RPC) runs at its
true speed, so measured in simulated seconds it costs ``1 / scale`` times what it would on a
real cluster: a scale below 1 makes the control plane look slower than it is (pessimistic).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SimClock:
    scale: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 10:
            raise ValueError(f"time scale must lie in (0, 10] wall seconds per simulated second, got {self.scale}")

    def hold(self, sim_s: float) -> None:
        """Block for ``sim_s`` simulated seconds (a device busy with a call)."""
        if sim_s > 0:
            time.sleep(sim_s * self.scale)

    def wall(self, sim_s: float) -> float:
        return sim_s * self.scale

    def sim(self, wall_s: float) -> float:
        return wall_s / self.scale
