"""The executor's state, shared by its parts (feeder, stage loops, rollout loops, update and
reports, weight sync): the stages and worker groups, the ledger of each step's rows, how far
each stage got, the policy versions, the accounts, and the lost rollout instances."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..single_controller.protocol import Group
from ..transfer_queue.protocol import AsyncTransferQueue
from .executor_config import ExecutorConfig
from .ledger import Ledger
from .reissue import RowsInFlight
from .stages import Stage
from .step_report import StepObserver, StepReport


@dataclass
class StageState:
    taken: dict[int, int] = field(default_factory=dict)  # step -> rows taken so far
    done: dict[int, int] = field(default_factory=dict)  # step -> rows whose call returned (worker map stages)
    low: int = 0  # steps below this one are done for the stage


class ExecutorState:
    """The attributes every part of the executor reads; the parts are mixins of this class."""

    def __init__(self, cfg: ExecutorConfig, stages: list[Stage], groups: dict[str, Group],
                 rollout_instances: list[Group], tq: AsyncTransferQueue,
                 source: Callable[[int, int], Awaitable[dict[str, Any]]],
                 *, timeline: Any = None, observers: Sequence[StepObserver] = (),
                 start_version: int = 0, first_step: int = 0, policy: str | None = None,
                 faults: Any = None):
        self.cfg = cfg
        self.stages = stages
        self.groups = groups
        # the role whose weights the rollout serves: the one that runs the update
        self.policy = policy or next(s.role for s in stages if s.kind == "update")
        self.instances = rollout_instances
        self.tq = tq
        self.source = source  # (step, n_prompts) -> columns of n_prompts * group_size new rows
        self.timeline = timeline
        self.observers = list(observers)
        self.ledger = Ledger()
        self.state = {s.name: StageState(low=first_step) for s in stages}
        self.filter_index = next((i for i, s in enumerate(stages) if s.kind == "filter"), None)
        self.actor_version = start_version
        self.instance_version = [start_version] * len(rollout_instances)  # receive issued (weights staged)
        self.published_version = start_version  # the newest version the actor has published
        self.first_step = first_step
        self.last_step: int | None = None  # set when the feeder stops issuing steps
        self._stop = False
        self.max_steps = 0  # set by run()
        self._sync_queue: asyncio.Queue[int] = asyncio.Queue()
        self.step_timing: dict[int, dict[str, float]] = {}
        self.step_metrics: dict[int, dict[str, float]] = {}  # what map stages reported, by step
        self.role_busy: dict[str, float] = {}
        self.step_started: dict[int, float] = {}
        self.prompts_issued = 0
        self._closers: set[asyncio.Task[Any]] = set()
        self._closer_errors: list[BaseException] = []
        self._closer_failed = asyncio.Event()
        # trained steps, in order: (step, its meta, the observers' columns read with it, report)
        self._reports: asyncio.Queue[tuple[int, Any, dict[str, Any], StepReport]] = asyncio.Queue()
        # Lost rollout instances (training.instance_faults.InstanceFaults; None: a loss ends the run)
        self.faults = faults
        self.rows_out = RowsInFlight()  # the rows each instance holds, and those a lost one gave back
        self.out_of_service: set[int] = set()
        self._written: dict[int, set[int]] = {}  # step -> rows known to have the rollout's outputs
        self._sync_members = list(range(len(rollout_instances)))  # instances in the weight-sync groups
        self._sync_stale = False  # a member was lost since the groups were made: make them again

    def instance_lost(self, k: int) -> None:
        """Instance ``k`` is lost (its process died or hangs): it takes no more rows."""
        self.out_of_service.add(k)
        self._sync_stale = True
        self.instance_version[k] = -1  # it holds no version until its new process swaps one in
        asyncio.get_running_loop().create_task(self.ledger.notify())

    def in_flight_uids(self, trained_through: int) -> list[int]:
        """Prompts issued to steps after ``trained_through``: what a checkpoint taken now
        must issue again on resume (their rows are not in any trained step)."""
        return sorted(u for t, s in self.ledger.steps.items() if t > trained_through for u in s.uids)

    def _finished(self, t: int) -> bool:
        return self.last_step is not None and t > self.last_step

    def _after_filter(self, index: int) -> bool:
        return self.filter_index is not None and index > self.filter_index

    def _forget(self, t: int) -> float | None:
        """Step ``t`` is trained, so every stage is done with it: drop its bookkeeping (a run of
        days has millions of steps) and return when it started."""
        self.ledger.steps.pop(t, None)
        self.step_metrics.pop(t, None)
        self.rows_out.forget(t)
        self._written.pop(t, None)
        for st in self.state.values():
            st.taken.pop(t, None)
            st.done.pop(t, None)
            st.low = max(st.low, t + 1)
        return self.step_started.pop(t, None)
