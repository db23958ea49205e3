"""Which rows each rollout instance holds, and the rows a lost instance gives back.

The executor records every batch it hands an instance (``hand_out``), under the step the
rows belong to. When the instance is lost, the rows of its batches that it had not written
yet (the TransferQueue says which it had) are given back (``give_back``) and handed out again
to the instances still serving (``take``), before any new rows; the rows it had written stay
where they are. Rows stay consumed by the rollout stage all along (the executor hands them
out itself), so no row is counted or generated twice: a given-back row is in exactly one
batch that is handed out again. A step's record is dropped once the step is trained (``forget``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RowsInFlight:
    held: dict[int, dict[int, list[Any]]] = field(default_factory=dict)  # instance -> step -> its batches
    returned: dict[int, list[Any]] = field(default_factory=dict)  # step -> batches to hand out again
    reissued_rows: int = 0  # rows given back so far, over the run

    def hand_out(self, instance: int, step: int, meta: Any) -> None:
        """``meta``'s rows of ``step`` go to ``instance``."""
        if len(meta):
            self.held.setdefault(instance, {}).setdefault(step, []).append(meta)

    def done_with(self, instance: int, step: int, meta: Any) -> None:
        """The instance's call with ``meta`` returned: every row of it is written (batch calls)."""
        batches = self.held.get(instance, {}).get(step, [])
        for i, m in enumerate(batches):
            if m is meta:
                del batches[i]
                return

    def held_by(self, instance: int) -> dict[int, list[Any]]:
        """Step -> the batches ``instance`` holds (rows of trained steps are forgotten)."""
        return {t: list(ms) for t, ms in self.held.get(instance, {}).items() if ms}

    def give_back(self, instance: int, unwritten: dict[int, list[Any]]) -> int:
        """``instance`` is lost: forget what it held; ``unwritten`` (step -> batches of its rows
        that have no output yet) is handed out again. Returns the rows given back."""
        self.held.pop(instance, None)
        n = 0
        for t, metas in unwritten.items():
            for m in metas:
                if len(m):
                    self.returned.setdefault(t, []).append(m)
                    n += len(m)
        self.reissued_rows += n
        return n

    def pending(self, allowed: Callable[[int], bool]) -> bool:
        """Given-back rows of a step that ``allowed`` lets the caller take."""
        return any(ms and allowed(t) for t, ms in self.returned.items())

    def take(self, allowed: Callable[[int], bool], cap: int = 0) -> tuple[int, Any] | None:
        """The oldest allowed step's next given-back batch, at most ``cap`` rows (0: all of it;
        the rest stays for the next take), or None."""
        for t in sorted(self.returned):
            metas = self.returned[t]
            if not metas or not allowed(t):
                continue
            meta = metas.pop(0)
            if cap and len(meta) > cap:
                metas.insert(0, meta.select(list(range(cap, len(meta)))))
                meta = meta.select(list(range(cap)))
            if not metas:
                del self.returned[t]
            return t, meta
        return None

    def forget(self, step: int) -> None:
        """``step`` is trained: none of its rows is held or due any more."""
        for per_step in self.held.values():
            per_step.pop(step, None)
        self.returned.pop(step, None)
