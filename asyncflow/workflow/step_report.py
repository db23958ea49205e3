"""What the executor tells about each trained step, and to whom (its observers)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..transfer_queue.columns import Column
from ..transfer_queue.meta import BatchMeta


@dataclass
class StepReport:
    step: int
    metrics: dict[str, float]
    timing: dict[str, float]
    rows: int
    started: float
    finished: float
    # Taken when the update finished, before any observer awaits: what a checkpoint of this
    # moment records (the data position and the prompts issued to later steps).
    next_uid: int = 0
    in_flight_uids: list[int] = field(default_factory=list)
    role_busy: dict[str, float] = field(default_factory=dict)  # seconds each role worked since the start
    # The TransferQueue units' stats once the step's rows are cleared (None: not read)
    tq_units: list[dict[str, Any]] | None = None


class StepObserver:
    """What the executor tells about each step, in step order: ``trained`` after the update (its
    rows are still in the TransferQueue), ``step_done`` once they are freed. Metrics, checkpoints,
    evaluations and the sample audit are observers; override what you need.

    ``reads``: columns of the trained rows that ``trained`` receives in ``columns`` (those the
    update's rows depend on come with the request that finds the rows ready; any other is read
    after the update, once for every observer).

    Both run off the update's path: the next update starts meanwhile unless an observer's
    ``holds_training(step)`` is true (the default), in which case it waits until every
    observer is done with ``step`` (a checkpoint must save the weights of that step)."""

    reads: tuple[str, ...] = ()

    async def trained(self, step: int, meta: BatchMeta | None, columns: Mapping[str, Column]) -> None:
        pass

    async def step_done(self, report: StepReport) -> None:
        pass

    def holds_training(self, step: int) -> bool:
        return True
