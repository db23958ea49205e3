"""Bounded busy-waiting for a reply: poll sockets for a short budget instead of sleeping, and
a policy that learns from the last waits whether spinning is worth it."""
from __future__ import annotations

import os
import time
from typing import Any

import zmq

# ---- bounded busy-waiting ------------------------------------------------------------------
# A ZMQ round trip wakes about six threads; where idle CPUs halt at once (e.g. a VM without
# guest halt-polling), each wake-up from idle adds a delay comparable to a small call's own
# round trip. A waiter that
# expects its message within a few hundred microseconds can instead poll its socket for that
# long and skip its own sleep and wake-up. Never longer than the budget, and only while
# recent waits were that short, so a waiter of long calls (training) does not spin at all.
# Only one side spins (the driver): with a spinner on each end, two busy threads on two
# cores starve the I/O threads that carry the messages, and a call gets slower than with no
# spinning at all.

def poll_ready(items: list[Any], budget_s: float) -> list[Any]:
    """Busy-poll ZMQ sockets: ``zmq_poll`` with a zero timeout, again and again, until one of
    ``items`` (``(socket, zmq.POLLIN)`` pairs) is ready or ``budget_s`` has passed; the
    ready ``(socket, events)`` pairs, or [] at the budget. Never sleeps; each try releases
    the GIL and yields the CPU to any runnable thread, so other threads of this
    process and of the machine run meanwhile."""
    deadline = time.perf_counter() + budget_s
    while True:
        ready = zmq.zmq_poll(items, 0)
        if ready or time.perf_counter() >= deadline:
            return ready
        # Let a thread waiting for this CPU run first (e.g. an I/O thread carrying the reply,
        # woken onto this CPU while the other is busy): without this it waits for preemption,
        # and on a loaded machine many more spins run out their whole budget.
        os.sched_yield()


class SpinPolicy:
    """Whether to busy-wait before sleeping, learned from the last waits: spin (up to
    ``budget_s``) only when the previous wait ended within ``ENGAGE`` budgets (a wait that
    slept includes the wake-up it could have saved, so the bar is a little above the budget).
    One slow wait turns spinning off until a wait is short again. A spin that runs out backs
    off: the next 1, 3, 7, ... up to ``MAX_SKIP`` waits sleep at once, so replies that keep
    coming just after the budget (a busy machine, where the spinner takes a CPU the replier
    needs) cost at most one budget per that many waits. ``budget_s`` 0 never spins."""

    ENGAGE = 1.5
    MAX_SKIP = 63
    __slots__ = ("budget_s", "_engage_s", "_fast", "_backoff", "_skip")

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self._engage_s = budget_s * self.ENGAGE
        self._fast = False  # unknown: the first wait sleeps
        self._backoff = 0  # waits to skip after the next spin that runs out
        self._skip = 0  # waits still to skip

    def budget(self) -> float:
        """Seconds to spin on the next wait (0: sleep at once). Call once per wait."""
        if not self._fast:
            return 0.0
        if self._skip:
            self._skip -= 1
            return 0.0
        return self.budget_s

    def observe(self, waited_s: float, spun: bool | None = None) -> None:
        """The whole duration of a wait that has ended (spinning, then sleeping if it did), and
        how its spin went: None (no spin), True (the spin got the reply), False (it ran out)."""
        if spun is False:
            self._backoff = min(2 * self._backoff + 1, self.MAX_SKIP)
            self._skip = self._backoff
        elif spun:
            self._backoff = 0
        self._fast = waited_s <= self._engage_s
