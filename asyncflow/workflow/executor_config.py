"""The executor's settings, and the TransferQueue partition that holds each step's rows."""
from __future__ import annotations

from dataclasses import dataclass

from .staleness import allowed_lag


def partition_name(step: int) -> str:
    return f"step{step}"


@dataclass
class ExecutorConfig:
    mode: str = "async"
    max_staleness: int = 1
    group_size: int = 8  # rows per prompt
    prompts_per_step: int = 32
    dynamic_sampling: bool = False
    max_refill_factor: float = 3.0
    wait_timeout_s: float = 600.0
    rollout_service: bool = False  # instances take rows as slots free (submit) instead of one call per batch
    swaps_at_once: int = 0  # instances swapping a new version in together (0: a quarter); never all of them

    def swap_wave(self, instances: int) -> int:
        """How many instances swap at once: never every one of several (the rest keep generating)."""
        k = self.swaps_at_once or max(1, instances // 4)
        return max(1, min(k, instances - 1)) if instances > 1 else 1

    @property
    def lag(self) -> int:
        return allowed_lag(self.mode, self.max_staleness)
