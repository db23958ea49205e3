"""The driver's account of each step's rows: issued, kept by a filter (dynamic sampling), closed.

A stage knows from it how many rows of a step it has yet to see, so it never waits
for rows that will not come: rows issued so far (or, for stages after a filter, rows
the filter kept), minus the rows it already took. A step is closed once
no more prompts will be issued for it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StepRows:
    issued: int = 0
    accepted: int = 0  # rows a filter kept
    accepted_groups: int = 0
    rejected_groups: int = 0
    prompts: int = 0
    closed: bool = False
    uids: list[int] = field(default_factory=list)  # prompts issued to the step, until it is trained


@dataclass
class Ledger:
    steps: dict[int, StepRows] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def step(self, t: int) -> StepRows:
        return self.steps.setdefault(t, StepRows())

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        # asyncio.timeout, not wait_for: wait_for runs the wait in a task of its own, and cancelling
        # that (a stage failed, the run is torn down) could hang on re-acquiring the condition.
        try:
            async with asyncio.timeout(timeout):
                async with self.changed:
                    await self.changed.wait_for(pred)
        except TimeoutError:
            raise TimeoutError(f"workflow: waited {timeout:.0f} s for {what}") from None

    def expected(self, t: int, after_filter: bool) -> int:
        """Rows of step ``t`` a stage will see: all issued ones, or, after a filter, the kept ones
        (a row not yet judged may still be dropped, so it does not count yet)."""
        s = self.step(t)
        return s.accepted if after_filter else s.issued
