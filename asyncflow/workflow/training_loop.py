"""The update stage's loop, step by step once a step is closed and its rows are ready, and the
step reports that follow each update (observers, then the step's rows cleared)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time

from ..transfer_queue.columns import Column
from ..transfer_queue.meta import BatchMeta
from .executor_config import partition_name
from .scheduling import Scheduling
from .stages import Stage, upstream_columns
from .step_report import StepReport
from .update_request import UpdateRequest

log = logging.getLogger(__name__)


class TrainingLoop(Scheduling):
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
                # The observers' columns that the update's rows depend on come with the same request.
                meta, read = await self._ready_rows(stage, t, n)
                request = UpdateRequest(partition_name(t), stage.name, n, self.cfg.wait_timeout_s)
                # The actor's ranks take one call at a time: version t's publish goes before
                # update t, else the rollout waits a whole update for the weights it needs.
                def published(t: int = t) -> bool:
                    return self.published_version >= t

                await self.ledger.wait_for(published, self.cfg.wait_timeout_s * 4,
                                           f"policy version {t} to be published before update {t}")
                results = await self._timed(stage, group.role, group.ranks, t, n,
                                            getattr(group, stage.method)(t, request.to_wire(), stage.io.to_wire()))
                metrics = {**self.step_metrics.get(t, {}),
                           **(dict(results[0]) if isinstance(results, list) else dict(results))}
                if self.faults is not None:  # the run's lost instances so far
                    metrics.update(self.faults.metrics())
            else:
                meta, read = None, {}
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
            self._reports.put_nowait((t, meta, read, report))
            # Waited for: a step an observer holds, or a reporter two steps behind (uncleared
            # rows must not pile up in the TransferQueue).
            if self._reports.qsize() > 1 or any(o.holds_training(t) for o in self.observers):
                await self._reported()
            t += 1

    async def _ready_rows(self, stage: Stage, t: int, n: int) -> tuple[BatchMeta, dict[str, Column]]:
        """Wait until the ``n`` rows of step ``t`` are ready for the update (under a task of their
        own, consuming nothing of the update's); with them, in one request, the columns the
        observers read that are written by then: those the update's rows depend on, and the
        prompt source's (no stage writes them: they come with the rows)."""
        task, partition = f"{stage.name}.ready", partition_name(t)
        fused = self._observer_reads[0]
        if not fused:
            return await self.tq.get_meta(stage.inputs, n, task, partition, timeout=self.cfg.wait_timeout_s), {}
        meta, data = await self.tq.get_batch_columns(stage.inputs, n, task, partition, data_columns=fused,
                                                     timeout=self.cfg.wait_timeout_s)
        return meta, dict(data or {})

    @functools.cached_property
    def _observer_reads(self) -> tuple[list[str], list[str]]:
        """(the observers' columns read with the update's ready rows, all their columns): fixed
        for the run (the stages and observers are), so worked out once."""
        upstream = upstream_columns(self.stages, next(s for s in self.stages if s.kind == "update"))
        by_stages = {c for s in self.stages for c in s.outputs}
        wanted = list(dict.fromkeys(c for o in self.observers for c in o.reads))
        return [c for c in wanted if c in upstream or c not in by_stages], wanted

    async def _reporter(self) -> None:
        """Each trained step in order: ``trained`` observers (its rows still stored), its rows
        cleared, then ``step_done`` observers."""
        while True:
            t, meta, read, report = await self._reports.get()
            try:
                if meta is not None:
                    rest = [c for c in self._observer_reads[1] if c not in read]
                    if rest:  # columns of stages the update does not depend on: read now, once for all
                        read = {**read, **await self.tq.get_columns(meta, rest)}
                    for o in self.observers:
                        await o.trained(t, meta, {c: read[c] for c in o.reads})
                # the units' stats come with the clear: the metrics check that nothing is left behind
                _, report.tq_units = await self.tq.clear_then_stats(partition_name(t))
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
