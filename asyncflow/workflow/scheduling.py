"""Which rows a stage takes next: the oldest open step with rows for it that its gate allows,
how many per call (the mode's batch; a streaming stage also takes what piled up while it
worked), and the bookkeeping of the rows each stage took."""
from __future__ import annotations

from collections.abc import Callable

from ..transfer_queue.meta import BatchMeta
from .accounting import StepAccounting
from .executor_config import partition_name
from .executor_state import StageState
from .stages import Stage

# _next_work's answer to a caller whose ``wake`` came true: compared by identity, never a step's work
WOKEN: tuple[int, int] = (-1, 0)


class Scheduling(StepAccounting):
    def _maps_done(self, t: int) -> bool:
        """Every map stage, the workers' and the driver's, has had all of step ``t``'s rows back
        from its calls (a stage the update does not wait for may still be writing them)."""
        for i, s in enumerate(self.stages):
            if s.kind not in ("rollout", "update", "filter"):
                if self.state[s.name].done.get(t, 0) < self.ledger.expected(t, self._after_filter(i)):
                    return False
        return True

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
                         st: StageState | None = None, cap: int = 0,
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
                    n = left if self._coalesces(stage) else self._batch(stage, t, left, after)
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

    def _coalesces(self, stage: Stage) -> bool:
        """A streaming stage that may take more than its batch in one call: every row of the
        step that is ready once its batch is (what piled up while it worked). The rollout
        keeps its batches (they are the engine's), the update takes the whole step anyway."""
        return self.cfg.mode != "sync" and stage.batch_rows > 0 and stage.kind in ("map", "filter")

    def _work_size(self, stage: Stage, n: int) -> tuple[int, int]:
        """(rows at most, rows at least) of one call given ``n`` rows of the step left to it."""
        if self._coalesces(stage):
            return n, min(n, stage.batch_rows)
        return n, 0

    def _took(self, stage: Stage, t: int, asked: int, got: int) -> None:
        """A coalescing call took ``got`` of the ``asked`` rows booked for it: the rest stay to come."""
        if got < asked:
            st = self.state[stage.name]
            st.taken[t] = st.taken.get(t, 0) - (asked - got)
