"""A simulated rollout engine: the real engine API (continuous batching, request by request,
per-row admission under the staleness bound, weight swaps between steps), with decode
steps that take the cost model's time instead of computing.

One ``step()`` sleeps until the next row finishes (or until ``nudge()``: a command for the
service loop arrived), then advances every running row by the decode steps that fit in the
time that passed. The time left over is the decode step in progress, and it belongs to the
rows running while it passed: a row admitted meanwhile joins at the end of that step (as a
continuous-batching engine adds rows between steps), so it never gets time from before its
admission. An idle engine keeps no time. Finished rows get response ids and behaviour
log-probs of their budgeted length (views of shared buffers: right sizes, no compute) and
each token's policy version. ``slowdown(version)`` scales the decode step time under each
weight version (a straggling instance, stragglers.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engines.rollout.base import GenerationRequest, RequestEngine, RequestResult
from .clock import SimClock
from .costs import CostModel

_VOCAB = 151_643  # Qwen2.5's vocabulary: token ids of the right range
_BUF_TOKENS = 1 << 16
_IDS = torch.randint(0, _VOCAB, (_BUF_TOKENS,), generator=torch.Generator().manual_seed(0))
_LOGPROBS = -torch.rand(_BUF_TOKENS, generator=torch.Generator().manual_seed(1)) * 2.0


@dataclass
class _SimulatedRow:
    request: GenerationRequest
    length: int  # tokens to generate
    done: int = 0
    versions: list[tuple[int, int]] = field(default_factory=list)  # (from token, version)

    def result(self, reason: str = "length") -> RequestResult:
        n = self.done
        versions = torch.empty(n, dtype=torch.long)
        bounds = [*self.versions, (n, -1)]
        for (start, v), (end, _) in zip(bounds, bounds[1:]):
            versions[start:end] = v
        off = (self.request.seed * 7919) % (_BUF_TOKENS - n) if n < _BUF_TOKENS else 0
        return RequestResult(self.request.request_id, _IDS[off:off + n], _LOGPROBS[off:off + n], versions, reason)


class SimRequestEngine(RequestEngine):
    """``capacity`` rows run at once; a row's length is its request's budget."""

    def __init__(self, costs: CostModel, clock: SimClock, capacity: int, swap_s: float = 0.0,
                 slowdown: Callable[[int], float] | None = None):
        self.costs, self.clock = costs, clock
        self.capacity = capacity
        self.swap_s = swap_s  # simulated seconds a swap pauses generation (loading staged weights)
        self.version = 0
        self._slowdown_of = slowdown or (lambda version: 1.0)
        self.slowdown = self._slowdown_of(0)
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[_SimulatedRow] = []
        self.joining: list[_SimulatedRow] = []  # admitted during a decode step: they join when it ends
        self._admit = True
        self._credit = 0.0  # simulated seconds into the decode step in progress (the running rows')
        self._debt = 0.0  # prefill (and swap) seconds owed before the next decode step
        self._mark = time.monotonic()
        self._nudge = threading.Event()
        self._finished_rows: list[_SimulatedRow] = []
        self.counters = {"finished": 0, "tokens": 0, "steps": 0, "aborted": 0, "unknown_aborts": 0, "errors": 0,
                         "swaps": 0, "admitted": 0}

    # ---- the RequestEngine API ---------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        self.waiting.append(request)

    def abort(self, request_id: Any) -> bool:
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                del self.waiting[i]
                self.counters["aborted"] += 1
                return True
        self.counters["unknown_aborts"] += 1
        return False

    def has_work(self) -> bool:
        if self.running or self.joining:
            return True
        return self._admit and any(r.min_version <= self.version for r in self.waiting)

    def admit(self, on: bool) -> None:
        self._admit = on

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        if version < self.version:
            raise ValueError(f"simulated engine: version {version} is older than the one held ({self.version})")
        self._spend(time.monotonic())
        self.version = int(version)
        self.slowdown = self._slowdown_of(self.version)
        for row in (*self.running, *self.joining):  # tokens from here on come from the new weights
            row.versions.append((row.done, self.version))
        self._debt += self.swap_s
        self.counters["swaps"] += 1

    def stats(self) -> dict:
        return {**self.counters, "running": len(self.running) + len(self.joining), "waiting": len(self.waiting),
                "version": self.version}

    def step(self) -> list[RequestResult]:
        now = time.monotonic()
        self._spend(now)
        finished = self._take_finished()
        self._admit_waiting()
        if finished or not self.running:
            return finished
        # Sleep until the next row would finish; a command for the service (nudge) cuts it short.
        dt = self._step_s()
        left = min(r.length - r.done for r in self.running)
        wait = max(0.0, self._debt + left * dt - self._credit)
        self._nudge.wait(self.clock.wall(wait))
        self._nudge.clear()
        self._spend(time.monotonic())
        return self._take_finished()

    def nudge(self) -> None:
        self._nudge.set()

    # ---- simulated time ----------------------------------------------------------------------
    def _step_s(self) -> float:
        ctx = sum(len(r.request.prompt_ids) + r.done for r in self.running) / len(self.running)
        return self.costs.decode_step_s(len(self.running), ctx) * self.slowdown

    def _join(self) -> None:
        """The rows admitted during the last decode step start now: their prefill is owed first."""
        for r in self.joining:
            self._debt += self.costs.prefill_s(len(r.request.prompt_ids))
        self.running.extend(self.joining)
        self.joining = []

    def _spend(self, now: float) -> None:
        """Advance the running rows by the time passed since the last call."""
        self._credit += self.clock.sim(now - self._mark)
        self._mark = now
        if not self.running:  # idle: the time passed is nobody's
            self._credit = 0.0
            self._join()
        while self.running and self._credit > 0:
            if self._debt > 0:
                paid = min(self._debt, self._credit)
                self._debt -= paid
                self._credit -= paid
                continue
            dt = self._step_s()
            left = min(r.length - r.done for r in self.running)
            # With rows waiting to join, only the step in progress is the running rows' alone.
            steps = min(1 if self.joining else left, int(self._credit / dt))
            if steps <= 0:
                return
            self._credit -= steps * dt
            for r in self.running:
                r.done += steps
            self.counters["steps"] += steps
            self.counters["tokens"] += steps * len(self.running)
            if steps == left:  # a row finished: the batch changes, so does the step time
                self._finished_rows.extend(r for r in self.running if r.done >= r.length)
                self.running = [r for r in self.running if r.done < r.length]
            self._join()  # a step boundary
        if not self.running:
            self._credit = 0.0  # an idle device banks no time

    def _take_finished(self) -> list[RequestResult]:
        out = [r.result() for r in self._finished_rows]
        self._finished_rows = []
        self.counters["finished"] += len(out)
        return out

    def _admit_waiting(self) -> None:
        """Admit what fits. Into an idle engine a row starts at once; into a running batch it joins
        when the decode step in progress ends (``_spend``), so the time already into that step stays
        with the rows that spent it."""
        if not self._admit:
            return
        kept: deque[GenerationRequest] = deque()
        while self.waiting:
            req = self.waiting.popleft()
            if len(self.running) + len(self.joining) >= self.capacity or req.min_version > self.version:
                kept.append(req)
                continue
            length = max(1, int(req.budget))
            self.joining.append(_SimulatedRow(req, length, 0, [(0, self.version)]))
            self.counters["admitted"] += 1
        self.waiting = kept
        if not self.running or self._credit <= 0:  # idle, or at a step boundary
            self._join()
