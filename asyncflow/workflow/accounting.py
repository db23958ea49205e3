"""The executor's accounts: the time each stage and role spent on each step (the step report's
timing, the timeline) and the metrics map stages return."""
from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

from .executor_state import ExecutorState
from .stages import Stage


class StepAccounting(ExecutorState):
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
