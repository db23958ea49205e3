"""The streaming executor: one asyncio task per stage, each looping get_meta -> call -> put.

Rows of step ``t`` live in TransferQueue partition ``step<t>``. A feeder issues each
step's prompts; every stage takes the step's rows as they become ready (``stream`` and
``async``) or all at once (``sync``), calls its worker group, and the worker writes
the new columns back. Overlap follows from the data alone. The mode decides only:

- batch size: ``sync`` takes the whole step per call, the others ``stage.batch_rows``;
- weights: rollout of step ``t`` needs policy version ``>= t - k`` with ``k = 0`` for
  ``sync``/``stream`` (on-policy) and ``k = max_staleness`` for ``async``. Version ``v``
  is the policy after ``v`` updates; update ``t`` turns version ``t`` into ``t + 1``, so
  a row generated for step ``t`` is at most ``k`` versions old when it trains.

Rollout instances are separate worker groups, each pulling rows on its own. With
``rollout_service`` (disaggregated placement) an instance is a service: the executor
keeps its running batch full by submitting rows whenever slots free (whole groups, up to
its capacity, so a faster instance gets more rows), and the instance writes each row to
the TransferQueue as soon as it finishes. Otherwise each call generates a batch of rows in
the rank's call queue (colocated roles take turns on their ranks).

Weights: each version is published once, received by every instance in the background,
then swapped in by the instances in waves (never all at once), so generation never stops everywhere.

A lost rollout instance (with ``faults``, the run's InstanceFaults: its process died or hung)
is taken out of service: the rows it held and had not written are handed out again to the
others (reissue.py), the weight-sync groups are made again without it, and once its new
process has joined it is back in the groups and takes rows again from the first version
it swaps in.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..single_controller.protocol import Group
from ..transfer_queue.meta import BatchMeta
from ..transfer_queue.protocol import AsyncTransferQueue
from ..weight_sync.publish import publish_and_swap
from .ledger import Ledger
from .reissue import RowsInFlight
from .stages import DRIVER, DriverBatch, Stage

log = logging.getLogger(__name__)


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
        return self.max_staleness if self.mode == "async" else 0


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


class StepObserver:
    """What the executor tells about each step, in step order: ``trained`` after the update (its
    rows are still in the TransferQueue), ``step_done`` once they are freed. Metrics, checkpoints,
    evaluations and the sample audit are observers; override what you need.

    Both run off the update's path: the next update starts meanwhile unless an observer's
    ``holds_training(step)`` is true (the default), in which case it waits until every
    observer is done with ``step`` (a checkpoint must save the weights of that step)."""

    async def trained(self, step: int, meta: BatchMeta | None) -> None:
        pass

    async def step_done(self, report: StepReport) -> None:
        pass

    def holds_training(self, step: int) -> bool:
        return True


@dataclass
class _StageState:
    taken: dict[int, int] = field(default_factory=dict)  # step -> rows taken so far
    done: dict[int, int] = field(default_factory=dict)  # step -> rows whose call returned (worker map stages)
    low: int = 0  # steps below this one are done for the stage


class Executor:
    """Runs a recipe's stages over steps ``0..`` until ``stop()`` or ``max_steps``."""

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
        self.state = {s.name: _StageState(low=first_step) for s in stages}
        self.filter_index = next((i for i, s in enumerate(stages) if s.kind == "filter"), None)
        self.actor_version = start_version
        self.instance_version = [start_version] * len(rollout_instances)  # receive issued (weights staged)
        self.published_version = start_version  # the newest version the actor has published
        self.first_step = first_step
        self.last_step: int | None = None  # set when the feeder stops issuing steps
        self._stop = False
        self._sync_queue: asyncio.Queue[int] = asyncio.Queue()
        self.step_timing: dict[int, dict[str, float]] = {}
        self.step_metrics: dict[int, dict[str, float]] = {}  # what map stages reported, by step
        self.role_busy: dict[str, float] = {}
        self.step_started: dict[int, float] = {}
        self.prompts_issued = 0
        self._closers: set[asyncio.Task[Any]] = set()
        self._closer_errors: list[BaseException] = []
        self._closer_failed = asyncio.Event()
        self._reports: asyncio.Queue[tuple[int, Any, StepReport]] = asyncio.Queue()  # trained steps, in order
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

    # ---- control ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Issue no new steps; the steps already issued run to the end."""
        self._stop = True

    async def run(self, max_steps: int) -> None:
        self.max_steps = max_steps
        tasks = [asyncio.create_task(self._feeder(), name="feeder"),
                 asyncio.create_task(self._watch_closers(), name="closers"),
                 asyncio.create_task(self._weight_sync(), name="weight-sync"),
                 asyncio.create_task(self._reporter(), name="reporter")]
        for i, s in enumerate(self.stages):
            if s.kind == "rollout":
                tasks += [asyncio.create_task(self._instance_loop(s, k), name=f"{s.name}[{k}]")
                          for k in range(len(self.instances))]
            elif s.kind == "update":
                tasks.append(asyncio.create_task(self._update_loop(s), name=s.name))
            elif s.kind == "filter":
                tasks.append(asyncio.create_task(self._filter_loop(s), name=s.name))
            elif s.role == DRIVER:
                tasks.append(asyncio.create_task(self._driver_loop(s, i), name=s.name))
            else:
                tasks.append(asyncio.create_task(self._map_loop(s, i), name=s.name))
        update_task = tasks[-1] if self.stages[-1].kind == "update" else None
        try:
            # The update stage ends the run; any task that fails ends it too, with that error.
            pending = set(tasks)
            while update_task is not None and not update_task.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if (err := t.exception()) is not None:
                        raise err
            if update_task is not None:
                update_task.result()
            # Deliver the versions already published: a send that nobody receives would block the actor.
            sync = next(t for t in tasks if t.get_name() == "weight-sync")
            joined = asyncio.ensure_future(self._sync_queue.join())
            await asyncio.wait([joined, sync], timeout=self.cfg.wait_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if sync.done() and (err := sync.exception()) is not None:
                raise err
            if not joined.done():
                joined.cancel()
                raise TimeoutError(f"workflow: weight sync did not deliver the last versions within "
                                   f"{self.cfg.wait_timeout_s:.0f} s")
        finally:
            for t in [*tasks, *self._closers]:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def in_flight_uids(self, trained_through: int) -> list[int]:
        """Prompts issued to steps after ``trained_through``: what a checkpoint taken now
        must issue again on resume (their rows are not in any trained step)."""
        return sorted(u for t, s in self.ledger.steps.items() if t > trained_through for u in s.uids)

    # ---- helpers ---------------------------------------------------------------------------
    def _finished(self, t: int) -> bool:
        return self.last_step is not None and t > self.last_step

    async def _timed(self, stage: Stage, role: str, ranks: list[int], step: int, rows: int,
                     call: Awaitable[Any]) -> Any:
        start = time.monotonic()
        t0 = self.timeline.now() if self.timeline is not None else 0.0
        result = await call
        dur = time.monotonic() - start
        self.role_busy[role] = self.role_busy.get(role, 0.0) + dur
        timing = self.step_timing.setdefault(step, {})
        timing[stage.name] = timing.get(stage.name, 0.0) + dur
        if self.timeline is not None:
            for r in ranks:
                self.timeline.record(f"rank{r} {role}", stage.name, t0, t0 + dur, step=step, rows=rows)
        return result

    def _maps_done(self, t: int) -> bool:
        """Every worker map stage has had all of step ``t``'s rows back from its calls."""
        for i, s in enumerate(self.stages):
            if s.kind not in ("rollout", "update", "filter") and s.role != DRIVER:
                if self.state[s.name].done.get(t, 0) < self.ledger.expected(t, self._after_filter(i)):
                    return False
        return True

    def _after_filter(self, index: int) -> bool:
        return self.filter_index is not None and index > self.filter_index

    def _batch(self, stage: Stage, t: int, left: int, after: bool) -> int:
        n = left
        if self.cfg.mode != "sync" and stage.batch_rows:
            n = min(n, stage.batch_rows)
        elif stage.kind == "rollout" and len(self.instances) > 1:  # sync: the step split over instances
            g = self.cfg.group_size
            share = -(-self.ledger.expected(t, after) // len(self.instances))
            n = min(n, -(-share // g) * g)
        # sync otherwise: every row issued so far (the step's global batch, or a refill round)
        return n

    async def _next_work(self, stage: Stage, index: int, allowed: Callable[[int], bool],
                         st: _StageState | None = None, cap: int = 0,
                         wake: Callable[[], bool] | None = None) -> tuple[int, int] | None:
        """(step, rows) to take next: the oldest open step with rows for this stage that
        ``allowed`` lets it work on; None once every step is done. A stage moves on to the
        next step while the last rows of the previous one are still being judged or refilled.
        ``wake`` (a rollout instance's: rows were given back, or it was lost): ``WOKEN`` as soon
        as it is true; such a caller also waits, rather than end, while steps are untrained
        (another instance's loss may still give rows back)."""
        st = st or self.state[stage.name]
        after = self._after_filter(index)
        found: list[tuple[int, int] | None] = []

        def pick() -> bool:
            if wake is not None and wake():
                found.append(WOKEN)
                return True
            while True:  # steps this stage is finished with
                t = st.low
                if self._finished(t):
                    if wake is not None and self.ledger.steps:
                        return False
                    found.append(None)
                    return True
                s = self.ledger.steps.get(t)
                if s is None or not (s.closed and self.ledger.expected(t, after) <= st.taken.get(t, 0)):
                    break
                st.low += 1
            for t in sorted(k for k in self.ledger.steps if k >= st.low):
                if not allowed(t):
                    break  # later steps need at least as much
                left = self.ledger.expected(t, after) - st.taken.get(t, 0)
                if left > 0:
                    n = self._batch(stage, t, left, after)
                    found.append((t, min(n, cap) if cap else n))
                    return True
            return False

        await self.ledger.wait_for(pick, self.cfg.wait_timeout_s * 4, f"rows for stage {stage.name!r} "
                                   f"(from step {st.low})")
        work = found[-1]
        if work is not None and work is not WOKEN:
            st.taken[work[0]] = st.taken.get(work[0], 0) + work[1]
        return work

    async def _get_meta(self, stage: Stage, t: int, n: int) -> BatchMeta:
        return await self.tq.get_meta(stage.inputs, n, stage.name, partition_name(t), stage.sampler,
                                      timeout=self.cfg.wait_timeout_s)

    # ---- the feeder: prompts in, steps closed ------------------------------------------------
    async def _feeder(self) -> None:
        cfg = self.cfg
        t = self.first_step
        while True:
            if self._stop or t - self.first_step >= self.max_steps:
                self.last_step = t - 1
                await self.ledger.notify()
                return
            # Issue step t once its rollout may start: version >= t - lag.
            def issuable(t: int = t) -> bool:
                return self.actor_version >= t - cfg.lag or self._stop

            await self.ledger.wait_for(issuable, cfg.wait_timeout_s * 4,
                                       f"policy version {t - cfg.lag} to issue step {t}")
            if self._stop:
                continue
            await self.tq.create_partition(partition_name(t))
            self.step_started[t] = time.monotonic()
            await self._issue(t, cfg.prompts_per_step)
            # Refilling and closing step t runs on its own, so step t+1 may start meanwhile.
            closing = asyncio.create_task(self._close_step(t), name=f"close-step{t}")
            self._closers.add(closing)
            closing.add_done_callback(self._closer_done)
            t += 1

    def _closer_done(self, task: asyncio.Task[Any]) -> None:
        self._closers.discard(task)
        if not task.cancelled() and (err := task.exception()) is not None:
            self._closer_errors.append(err)
            self._closer_failed.set()

    async def _watch_closers(self) -> None:
        await self._closer_failed.wait()
        raise self._closer_errors[0]

    async def _close_step(self, t: int) -> None:
        if self.cfg.dynamic_sampling:
            await self._refill(t)
        self.ledger.step(t).closed = True
        await self.tq.close_partition(partition_name(t))
        await self.ledger.notify()

    async def _issue(self, t: int, n_prompts: int) -> None:
        cols = await self.source(t, n_prompts)
        n_rows = n_prompts * self.cfg.group_size
        groups = cols.pop("__groups__", None)
        s = self.ledger.step(t)
        if groups is not None:  # before any await: a checkpoint may look at the ledger meanwhile
            s.uids.extend(dict.fromkeys(groups))
        await self.tq.put(cols, partition_name(t), groups=groups)
        s.issued += n_rows
        s.prompts += n_prompts
        self.prompts_issued += n_prompts
        await self.ledger.notify()

    async def _refill(self, t: int) -> None:
        """Dynamic sampling: replace dropped groups with new prompts until the step is full."""
        cfg = self.cfg
        budget = int(cfg.prompts_per_step * cfg.max_refill_factor)
        s = self.ledger.step(t)
        while True:
            await self.ledger.wait_for(
                lambda: s.accepted_groups + s.rejected_groups >= s.prompts, cfg.wait_timeout_s,
                f"the filter's decision on every group of step {t}")
            missing = cfg.prompts_per_step - s.accepted_groups
            if missing <= 0 or s.prompts >= budget:
                if missing > 0 and cfg.max_refill_factor > 1:
                    log.warning("step %d: only %d of %d groups have reward variance after %d prompts; "
                                "training on those", t, s.accepted_groups, cfg.prompts_per_step, s.prompts)
                return
            await self._issue(t, min(missing, budget - s.prompts))

    # ---- stage loops -----------------------------------------------------------------------
    async def _service_loop(self, stage: Stage, k: int) -> None:
        """Keep instance ``k``'s running batch full: submit whole groups as its slots free."""
        inst = self.instances[k]
        index = self.stages.index(stage)
        lag, g = self.cfg.lag, self.cfg.group_size
        io = stage.io.to_wire()
        free = await inst.capacity()
        if free < g:
            raise ValueError(f"rollout instance {k} holds at most {free} rows in flight, less than one group "
                             f"({g} rows): raise rollout.max_running_rows")
        def allowed(t: int) -> bool:
            return self.instance_version[k] >= t - lag

        def wake() -> bool:  # lost, or rows given back by a lost instance that this one may take
            return k in self.out_of_service or self.rows_out.pending(allowed)

        while k not in self.out_of_service:
            while free < g:  # every slot is taken: wait for rows to finish
                free = self._account(stage, inst, await inst.submit(None, 0, want_free=g, wait_s=5.0))
            cap = free // g * g
            given_back = self.rows_out.take(allowed, cap)  # a lost instance's rows go first
            if given_back is not None:
                t, meta = given_back
            else:
                work = await self._next_work(stage, index, allowed, cap=cap,
                                             wake=wake if self.faults is not None else None)
                if work is None:
                    break
                if work is WOKEN:
                    continue
                t, n = work
                meta = await self._get_meta(stage, t, n)
            self.rows_out.hand_out(k, t, meta)
            free = self._account(stage, inst, await inst.submit(meta, max(0, t - lag), want_free=g, wait_s=5.0,
                                                                io=io))
        if k in self.out_of_service:
            return
        # every row is out: what is left to report is the time it took
        self._account(stage, inst, await inst.submit(None, 0, want_free=0, wait_s=0.0))

    def _account(self, stage: Stage, inst: Any, report: dict[str, Any]) -> int:
        """Book an instance's engine time by step (what its rows cost); return its free rows."""
        now = self.timeline.now() if self.timeline is not None else 0.0
        open_steps = list(self.ledger.steps)
        for part, busy in report["busy_s"].items():
            t = int(part[len("step"):])
            if t not in self.ledger.steps:  # already trained: the time goes to the oldest open step
                if not open_steps:
                    continue
                t = min(open_steps)
            timing = self.step_timing.setdefault(t, {})
            timing[stage.name] = timing.get(stage.name, 0.0) + busy
            self.role_busy[inst.role] = self.role_busy.get(inst.role, 0.0) + busy
            if self.timeline is not None and busy > 0:
                for r in inst.ranks:
                    self.timeline.record(f"rank{r} {inst.role}", stage.name, now - busy, now, step=t,
                                         rows=report["written"].get(part, 0))
        return int(report["free"])

    async def _instance_loop(self, stage: Stage, k: int) -> None:
        """Instance ``k``'s rollout loop; with ``faults``, a lost instance's rows are given back,
        and the loop starts again once its new process has joined."""
        while True:
            try:
                await self._rollout_loop(stage, k)
                if k not in self.out_of_service:
                    return
            except Exception as e:
                if self.faults is None or not (k in self.out_of_service or self.faults.is_loss(e)):
                    raise
                self.instance_lost(k)
            await self.faults.confirm_dead(k)  # no late write may come from it once its rows are given back
            await self._give_back(stage, k)
            await self.faults.back_in_service(k)  # a new process, or the run stops (the restart budget)
            self.out_of_service.discard(k)
            await self.ledger.notify()

    async def _give_back(self, stage: Stage, k: int) -> None:
        """The rows lost instance ``k`` held and had not written go to the other instances."""
        unwritten: dict[int, list[Any]] = {}
        for t, metas in self.rows_out.held_by(k).items():
            written = await self._written_rows(stage, t)
            for m in metas:
                keep = [i for i, r in enumerate(m.rows) if r not in written]
                if keep:
                    unwritten.setdefault(t, []).append(m if len(keep) == len(m) else m.select(keep))
        n = self.rows_out.give_back(k, unwritten)
        if n:
            log.warning("rollout instance %d is lost: %d rows it held are generated again by the others "
                        "(steps %s)", k, n, sorted(unwritten))
        self.faults.reissued(k, n)
        await self.ledger.notify()

    async def _written_rows(self, stage: Stage, t: int) -> set[int]:
        """Rows of step ``t`` that have the rollout's first output: read through a task of their
        own (every row once), so the stages' own consumption is untouched."""
        seen = self._written.setdefault(t, set())
        s = self.ledger.steps.get(t)
        if s is not None and s.issued:
            meta = await self.tq.get_meta([stage.outputs[0]], s.issued, f"{stage.name}.written", partition_name(t),
                                          allow_partial=True, timeout=0.0)
            seen.update(meta.rows)
        return seen

    async def _rollout_loop(self, stage: Stage, k: int) -> None:
        if self.cfg.rollout_service:
            return await self._service_loop(stage, k)
        inst = self.instances[k]
        index = self.stages.index(stage)
        lag = self.cfg.lag
        # Instances share the stage's row count (they pull from the same rows) but not the
        # weights gate: each takes step t once it holds version >= t - lag.
        while work := await self._next_work(stage, index, lambda t: self.instance_version[k] >= t - lag):
            t, n = work
            meta = await self._get_meta(stage, t, n)
            await self._timed(stage, inst.role, inst.ranks, t, n,
                              getattr(inst, stage.method)(meta, max(0, t - lag), stage.io.to_wire()))

    async def _map_loop(self, stage: Stage, index: int) -> None:
        group = self.groups[stage.role]
        # proximal log-probs (on_policy_weights): the weights that update t starts from
        allowed = (lambda t: self.actor_version >= t) if stage.on_policy_weights else (lambda t: True)
        while work := await self._next_work(stage, index, allowed):
            t, n = work
            meta = await self._get_meta(stage, t, n)
            out = await self._timed(stage, group.role, group.ranks, t, n,
                                    getattr(group, stage.method)(meta, stage.io.to_wire()))
            self._keep_metrics(t, out)
            done = self.state[stage.name].done
            done[t] = done.get(t, 0) + n
            await self.ledger.notify()

    async def _driver_batch(self, stage: Stage, t: int, n: int) -> tuple[Any, DriverBatch]:
        """The stage's next ``n`` rows of step ``t`` and their columns: one TransferQueue request
        (get_batch) where the service holds the rows, as a driver stage reads what it takes."""
        meta, cols = await self.tq.get_batch_columns(stage.inputs, n, stage.name, partition_name(t), stage.sampler,
                                                     timeout=self.cfg.wait_timeout_s)
        if cols is None:  # no rows: the columns of none
            cols = await self.tq.get_columns(meta, list(stage.inputs))
        return meta, DriverBatch(t, {c: _plain(col) for c, col in cols.items()},
                                 list(meta.groups) if meta.groups else list(range(len(meta))), dict(stage.options))

    async def _run_fn(self, stage: Stage, batch: DriverBatch) -> Any:
        """The stage's function, off the event loop (it may be heavy tensor math)."""
        if stage.fn is None:  # check_graph: a driver stage names its function
            raise ValueError(f"driver stage {stage.name!r} has no function")
        try:
            return await asyncio.to_thread(stage.fn, batch)
        except Exception as e:
            raise RuntimeError(f"driver stage {stage.name!r} ({_fn_name(stage.fn)}) raised at step {batch.step}: "
                               f"{type(e).__name__}: {e}") from e

    async def _driver_loop(self, stage: Stage, index: int) -> None:
        """A driver stage: its function computes new columns from the batch's columns."""
        while work := await self._next_work(stage, index, lambda t: True):
            t, n = work
            meta, batch = await self._driver_batch(stage, t, n)
            start = time.monotonic()
            out = _outputs(stage, await self._run_fn(stage, batch), len(meta))
            if out:
                await self.tq.put(out, partition_name(t), meta)
            timing = self.step_timing.setdefault(t, {})
            timing[stage.name] = timing.get(stage.name, 0.0) + time.monotonic() - start

    async def _filter_loop(self, stage: Stage) -> None:
        """Driver-side: the stage's function keeps or drops whole groups (dynamic sampling);
        dropped rows leave the step, kept rows get the stage's output column (the gate the
        later stages read), and the step is refilled with new prompts until it is full."""
        index = self.stages.index(stage)
        while work := await self._next_work(stage, index, lambda t: True):
            t, n = work
            meta, batch = await self._driver_batch(stage, t, n)
            keep_mask = await self._run_fn(stage, batch)
            keep_rows = _keep_mask(stage, keep_mask, batch)
            keep = {g for g, k in zip(batch.groups, keep_rows) if k}
            rows_keep = [i for i, k in enumerate(keep_rows) if k]
            rows_drop = [i for i, k in enumerate(keep_rows) if not k]
            s = self.ledger.step(t)
            if rows_drop:
                await self.tq.clear_rows(meta.select(rows_drop))
            s.accepted += len(rows_keep)
            if rows_keep and stage.outputs:
                import torch
                await self.tq.put({stage.outputs[0]: torch.ones(len(rows_keep), dtype=torch.int8)},
                                  partition_name(t), meta.select(rows_keep))
            s.accepted_groups += len(keep)
            s.rejected_groups += len(set(batch.groups)) - len(keep)
            await self.ledger.notify()

    async def _update_loop(self, stage: Stage) -> None:
        group = self.groups[stage.role]
        index = self.stages.index(stage)
        t = self.first_step
        while True:
            def closed(t: int = t) -> bool:
                return self._finished(t) or (t in self.ledger.steps and self.ledger.steps[t].closed)

            await self.ledger.wait_for(closed, self.cfg.wait_timeout_s * 4, f"step {t} to be closed")
            if self._finished(t):
                await self._reported()  # the last steps' reports are out before the run ends
                return
            n = self.ledger.expected(t, self._after_filter(index))
            metrics: dict[str, float] = {}
            if n > 0:
                self.state[stage.name].taken[t] = n
                # Wait here until the step's rows are ready (under a task of its own, consuming
                # nothing of the update's): the update then holds its ranks only to train. Its
                # ranks fetch their own shares of the rows (token-balanced, sampled once for all).
                meta = await self.tq.get_meta(stage.inputs, n, f"{stage.name}.ready", partition_name(t),
                                              timeout=self.cfg.wait_timeout_s)
                batch = {"partition": partition_name(t), "task": stage.name, "rows": n,
                         "timeout_s": self.cfg.wait_timeout_s}
                # The actor's ranks take one call at a time: version t's publish goes before
                # update t, else the rollout waits a whole update for the weights it needs.
                def published(t: int = t) -> bool:
                    return self.published_version >= t

                await self.ledger.wait_for(published, self.cfg.wait_timeout_s * 4,
                                           f"policy version {t} to be published before update {t}")
                results = await self._timed(stage, group.role, group.ranks, t, n,
                                            getattr(group, stage.method)(t, batch, stage.io.to_wire()))
                metrics = {**self.step_metrics.get(t, {}),
                           **(dict(results[0]) if isinstance(results, list) else dict(results))}
                if self.faults is not None:  # the run's lost instances so far
                    metrics.update(self.faults.metrics())
            else:
                meta = None
                log.warning("step %d: no rows left to train on; the policy is unchanged", t)
            # A worker stage beside the update (PPO's critic update) may still read step t:
            # its rows are cleared only once every such stage is done with them.
            def maps_done(t: int = t) -> bool:
                return self._maps_done(t)

            await self.ledger.wait_for(maps_done, self.cfg.wait_timeout_s * 4,
                                       f"the worker stages of step {t} to finish")
            self.actor_version = t + 1
            now = time.monotonic()
            report = StepReport(t, metrics, {}, n, now, now, next_uid=int(getattr(self.source, "next_uid", 0)),
                                in_flight_uids=self.in_flight_uids(t), role_busy=dict(self.role_busy))
            started = self._forget(t)
            report.started = started if started is not None else now
            report.timing = dict(self.step_timing.pop(t, {}))
            await self.ledger.notify()
            self._sync_queue.put_nowait(t + 1)
            # The step's audit, clearing and reports follow in the reporter, while the next
            # update trains, unless an observer holds training for this step (a checkpoint).
            self._reports.put_nowait((t, meta, report))
            # Waited for: a step an observer holds, or a reporter two steps behind (uncleared
            # rows must not pile up in the TransferQueue).
            if self._reports.qsize() > 1 or any(o.holds_training(t) for o in self.observers):
                await self._reported()
            t += 1

    async def _reporter(self) -> None:
        """Each trained step in order: ``trained`` observers (its rows still stored), its rows
        cleared, then ``step_done`` observers."""
        while True:
            t, meta, report = await self._reports.get()
            try:
                if meta is not None:
                    for o in self.observers:
                        await o.trained(t, meta)
                await self.tq.clear(partition_name(t))
                for o in self.observers:
                    await o.step_done(report)
            finally:
                self._reports.task_done()

    async def _reported(self) -> None:
        """Wait until the reporter is done with every trained step (a failure of its own ends the run)."""
        # asyncio.wait, not wait_for: on Python 3.11 wait_for returns the join's result and drops
        # a cancellation that comes in the same loop round (the run ending on the reporter's error).
        joined = asyncio.ensure_future(self._reports.join())
        try:
            done, _ = await asyncio.wait([joined], timeout=self.cfg.wait_timeout_s * 4)
        finally:
            if not joined.done():
                joined.cancel()
        if not done:
            raise TimeoutError(f"workflow: the step observers did not finish within "
                               f"{self.cfg.wait_timeout_s * 4:.0f} s")

    def _keep_metrics(self, t: int, out: Any) -> None:
        """A map stage that returns metrics (a dict of numbers, or one per rank: the first is
        kept) adds them to its step's report, e.g. the critic update's value loss."""
        first = out[0] if isinstance(out, list) and out else out
        if t not in self.ledger.steps:  # its step is reported already: the next report carries them
            if not self.ledger.steps:
                return
            t = min(self.ledger.steps)
        if isinstance(first, dict):
            self.step_metrics.setdefault(t, {}).update(
                {k: float(v) for k, v in first.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

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

    async def _unless_member_lost(self, sync: Awaitable[None], members: list[int]) -> None:
        """Run a weight sync; if one of ``members`` is lost meanwhile, stop waiting for it and
        raise InstanceLostInSync: the others may wait on its groups until their timeout (a
        receive in progress cannot be ended), so the version goes again over new groups,
        into a new intake on each instance; the old waits end at weight_sync.timeout_s."""
        task = asyncio.ensure_future(sync)
        lost = asyncio.ensure_future(self.ledger.wait_for(lambda: any(k in self.out_of_service for k in members),
                                                          self.cfg.wait_timeout_s * 4, "a lost rollout instance"))
        try:
            await asyncio.wait([task, lost], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
            await asyncio.gather(lost, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise InstanceLostInSync(f"a rollout instance of {members} was lost during the weight sync")
        await task

    # ---- weight sync: publish each version, then every instance receives it in the background ----
    async def _weight_sync(self) -> None:
        actor = self.groups[self.policy]
        while True:
            v = await self._sync_queue.get()
            taken = 1
            while not self._sync_queue.empty():  # an instance far behind takes the newest only
                v = self._sync_queue.get_nowait()
                taken += 1

            # The callbacks bind this iteration's version (publish_and_swap awaits them before the next).
            async def published(v: int = v) -> None:
                self.published_version = v
                await self.ledger.notify()

            async def swapped(members: list[int], v: int = v) -> None:
                for k in members:
                    self.instance_version[k] = v
                await self.ledger.notify()

            # Every instance starts receiving in the background (generating meanwhile), then the
            # actor ranks send; then the instances swap the new weights in, in waves of
            # cfg.swap_wave(n), so that at no moment are all of them paused (weight_sync.load=staged).
            # Each call is timed under step v: the step whose rollout the new weights serve (and
            # whose metrics log it).
            async def timed(g: Group, call: Awaitable[Any], v: int = v) -> Any:
                out = await self._timed(_SYNC, g.role, g.ranks, v, 0, call)
                first = out[0] if isinstance(out, list) and out else out
                if g is actor and isinstance(first, dict) and "bytes" in first:
                    # what one version moved (all tensors, in the rollout dtype): with LoRA, the adapters
                    self._keep_metrics(v, {"weight_sync/bytes": first["bytes"],
                                           "weight_sync/tensors": first.get("tensors", 0)})
                return out

            while True:
                members = [k for k in range(len(self.instances)) if k not in self.out_of_service]

                async def swapped_members(idx: list[int], members: list[int] = members) -> None:
                    await swapped([members[i] for i in idx])
                try:
                    if self.faults is not None and (self._sync_stale or members != self._sync_members):
                        # an instance was lost or has joined again: new groups of the ones serving (a
                        # member lost while they are made: made again without it, as in the sync below)
                        self._sync_stale = False
                        await self._unless_member_lost(
                            self.faults.rebuild_sync([self.instances[k] for k in members]), members)
                        self._sync_members = members
                    sync = publish_and_swap(actor, [self.instances[k] for k in members], v,
                                            wave=self.cfg.swap_wave(len(members)),
                                            timed=timed, on_published=published, on_swapped=swapped_members)
                    await (sync if self.faults is None else self._unless_member_lost(sync, members))
                    break
                except Exception:
                    # a member lost during the sync: make the groups without it and send v again
                    if self.faults is None or not await self.faults.lost_meanwhile(members, self.out_of_service):
                        raise
                    self._sync_stale = True
                    log.warning("weight sync of version %d: a rollout instance was lost meanwhile; sending it "
                                "again to the others", v)
            for _ in range(taken):
                self._sync_queue.task_done()


_SYNC = Stage("weight_sync", role="actor", method="publish_weights", inputs=["-"], kind="map")
class InstanceLostInSync(RuntimeError):
    """A weight sync given up because one of its instances was lost (it is sent again)."""


# _next_work's answer to a caller whose ``wake`` came true: compared by identity, never a step's work
WOKEN: tuple[int, int] = (-1, 0)


def _plain(col: Any) -> Any:
    """A TransferQueue column as a driver function sees it: a tensor per fixed column, a list
    of 1-D tensors per jagged one, a list per object column."""
    if col.kind == "object":
        return list(col.items)
    if col.kind == "jagged":
        offs = col.offsets.tolist()
        return [col.values[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
    return col.data


def _fn_name(fn: Any) -> str:
    """The function's name and the file that defines it (the recipe's, usually)."""
    import inspect
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        return f"{name} in {inspect.getsourcefile(fn)}"
    except TypeError:  # a builtin or a callable object
        return name


def _outputs(stage: Stage, out: Any, n: int) -> dict[str, Any]:
    """A driver function's result as the stage's declared output columns."""
    if len(stage.outputs) == 1 and not isinstance(out, dict):
        out = {stage.outputs[0]: out}
    if not isinstance(out, dict):
        raise TypeError(f"driver stage {stage.name!r}: {_fn_name(stage.fn)} must return a dict of its output "
                        f"columns {stage.outputs}, got {type(out).__name__}")
    missing = [c for c in stage.outputs if c not in out]
    if missing:
        raise ValueError(f"driver stage {stage.name!r}: {_fn_name(stage.fn)} returned {sorted(out)}, "
                         f"without its declared outputs {missing}")
    for c in stage.outputs:
        if len(out[c]) != n:
            raise ValueError(f"driver stage {stage.name!r}: column {c!r} has {len(out[c])} rows for a batch of {n}")
    return {c: out[c] for c in stage.outputs}


def _keep_mask(stage: Stage, keep: Any, batch: DriverBatch) -> list[bool]:
    """A filter function's result as one bool per row, deciding whole groups."""
    flags = [bool(k) for k in (keep.tolist() if hasattr(keep, "tolist") else keep)]
    if len(flags) != len(batch):
        raise ValueError(f"filter stage {stage.name!r}: {_fn_name(stage.fn)} returned {len(flags)} flags for "
                         f"{len(batch)} rows (one bool per row: True keeps it)")
    decided: dict[int, bool] = {}
    for g, k in zip(batch.groups, flags):
        if decided.setdefault(g, k) != k:
            raise ValueError(f"filter stage {stage.name!r}: {_fn_name(stage.fn)} keeps part of group {g}; a "
                             "filter keeps or drops whole groups (the group sampler gives it whole groups)")
    return flags
