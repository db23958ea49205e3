"""The rollout instances' loops: a call per batch, or (``rollout_service``) the instance's running
batch kept full; with faults, a lost instance's unwritten rows are given to the others."""
from __future__ import annotations

import logging
from typing import Any

from .executor_config import partition_name
from .scheduling import WOKEN, Scheduling
from .stages import Stage
from .staleness import min_version

log = logging.getLogger(__name__)


class RolloutLoops(Scheduling):
    async def _rollout_loop(self, stage: Stage, k: int) -> None:
        if self.cfg.rollout_service:
            return await self._service_loop(stage, k)
        inst = self.instances[k]
        index = self.stages.index(stage)
        lag = self.cfg.lag
        # Instances share the stage's row count (they pull from the same rows) but not the
        # weights gate: each takes step t once it holds version >= t - lag.
        while work := await self._next_work(stage, index, lambda t: self.instance_version[k] >= min_version(t, lag)):
            t, n = work
            meta = await self._get_meta(stage, t, n)
            await self._timed(stage, inst.role, inst.ranks, t, n,
                              getattr(inst, stage.method)(meta, min_version(t, lag), stage.io.to_wire()))

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
            return self.instance_version[k] >= min_version(t, lag)

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
            free = self._account(stage, inst, await inst.submit(meta, min_version(t, lag), want_free=g, wait_s=5.0,
                                                                io=io))
        if k in self.out_of_service:
            return
        # every row is out: what is left to report is the time it took
        self._account(stage, inst, await inst.submit(None, 0, want_free=0, wait_s=0.0))

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
