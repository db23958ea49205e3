"""Score a batch of responses with a reward function, with a timeout per call.

A Python thread cannot be killed, so a call that exceeds the timeout is abandoned:
its worker thread keeps running in the background (a daemon, it does not keep the
process alive) and a fresh worker takes the remaining rows. Abandoned threads that
are still running are capped (`max_abandoned`); past the cap the runner raises
instead of leaking threads. A reward that can truly hang (a solver, an external
call) belongs in a subprocess, with the runner's timeout as the outer guard.

A function may return a dict instead of a number: its ``score`` is the row's score and its
other numeric (or boolean) values are summed per key into ``stats["extra"]`` (verl's
``reward_extra_info``), for the metrics ``reward/extra/<key>`` and ``eval/extra/<key>``.
A ``RewardContractError`` (a file reward returning something else) is raised whatever
``on_error`` says: it is a mistake to fix, not a row to score 0.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from asyncflow.rewards.custom import resolve_reward
from asyncflow.rewards.registry import RewardContractError, RewardFn

__all__ = ["RewardError", "RewardRunner", "extra_means"]

_STOP = object()


class RewardError(RuntimeError):
    """A reward call failed or timed out under on_error="fail", or too many calls hung."""


def _number(v: Any) -> float | None:
    """A finite float of a number or a bool; None for anything else."""
    if isinstance(v, numbers.Real) and math.isfinite(float(v)):
        return float(v)
    return None


def _split(value: Any) -> tuple[float | None, dict[str, float]]:
    """(score, numeric extras) of what a reward returned; score None when it is not a finite
    number (a bool is not a score), nor a dict with one under ``score``."""
    if isinstance(value, dict):
        score = value.get("score")
        extras = {str(k): x for k, v in value.items() if k != "score" and (x := _number(v)) is not None}
        value = score
    else:
        extras = {}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, {}
    return float(value), extras


def extra_means(totals: Mapping[str, Sequence[float]], since: Mapping[str, Sequence[float]] | None = None
                ) -> dict[str, float]:
    """Per key, the mean of the extras summed in ``totals`` ({key: (sum, count)}), over the rows
    counted since ``since`` (an earlier reading of the same totals); keys with no new row left out."""
    out = {}
    for k, (s, n) in totals.items():
        s0, n0 = (since or {}).get(k, (0.0, 0))
        if n - n0 > 0:
            out[k] = (s - s0) / (n - n0)
    return out


class _Worker:
    """A daemon thread running reward calls one at a time from its inbox."""

    def __init__(self, fn: RewardFn, name: str) -> None:
        self.fn = fn
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.cancelled = False  # set when abandoned: the rows still queued are not run
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.inbox.get()
            if job is _STOP or self.cancelled:
                return
            row, response, answer, meta = job
            try:
                self.outbox.put((row, True, self.fn(response, answer, **meta)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                self.outbox.put((row, False, exc))


class RewardRunner:
    """Scores batches with one reward function (a registered name or a callable).

    on_error="zero": a call that raises, returns a non-number or exceeds timeout_s
    scores 0.0 and is counted in the stats; on_error="fail": it raises RewardError
    naming the function, the row and the cause.
    """

    def __init__(
        self,
        name_or_fn: str | RewardFn,
        timeout_s: float = 10.0,
        on_error: Literal["zero", "fail"] = "zero",
        max_abandoned: int = 4,
    ) -> None:
        if on_error not in ("zero", "fail"):
            raise ValueError(f"RewardRunner: on_error {on_error!r}; expected 'zero' or 'fail'")
        if not timeout_s > 0:
            raise ValueError(f"RewardRunner: timeout_s must be > 0, got {timeout_s}")
        self.fn = resolve_reward(name_or_fn)
        self.name = getattr(self.fn, "display_name", None) or (
            name_or_fn if isinstance(name_or_fn, str) else getattr(self.fn, "__qualname__", repr(self.fn)))
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.max_abandoned = max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._spawned = 0
        self._worker: _Worker | None = None

    def _new_worker(self) -> _Worker:
        self._spawned += 1
        return _Worker(self.fn, f"reward-{self.name}-{self._spawned}")

    @property
    def num_hung(self) -> int:
        """Abandoned calls still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def _abandon(self, worker: _Worker, row: int) -> None:
        worker.cancelled = True
        worker.inbox.put(_STOP)  # it exits if the hung call ever returns
        self._abandoned.append(worker.thread)
        self._worker = None
        if self.num_hung > self.max_abandoned:
            raise RewardError(
                f"reward {self.name!r}: {self.num_hung} calls are still running past timeout_s={self.timeout_s} "
                f"(latest on row {row}); threads cannot be killed, so the runner stops rather than leak more. "
                f"Fix the function, raise timeout_s, or run it in a subprocess."
            )

    def _fail_or_count(self, msg: str, cause: BaseException | None) -> None:
        if self.on_error == "fail":
            raise RewardError(msg) from cause

    def score(
        self, responses: Sequence[str], answers: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> tuple[list[float], dict[str, Any]]:
        """Scores in row order, and stats {"rows", "errors", "timeouts", "hung", "first_error", "extra"};
        "extra" is {key: [sum, rows]} of the numeric extras that dict results carried."""
        metadata = list(metadata) if metadata is not None else [{} for _ in responses]
        if not len(responses) == len(answers) == len(metadata):
            raise ValueError(
                f"RewardRunner.score: lengths differ: {len(responses)} responses, {len(answers)} answers, "
                f"{len(metadata)} metadata"
            )
        scores: list[float] = []
        extra: dict[str, list[float]] = {}
        errors = timeouts = 0
        first_error: str | None = None
        rows = list(zip(responses, answers, metadata))
        row = 0
        while row < len(rows):
            worker = self._worker or self._new_worker()
            self._worker = worker
            # Queue every remaining row at once: the worker streams results back in row order,
            # so waiting for one result takes about that row's own time (the per-call timeout).
            for j in range(row, len(rows)):
                response, answer, meta = rows[j]
                worker.inbox.put((j, response, answer, dict(meta or {})))
            while row < len(rows):
                try:
                    _, ok, value = worker.outbox.get(timeout=self.timeout_s)
                except queue.Empty:
                    timeouts += 1
                    msg = f"reward {self.name!r} exceeded timeout_s={self.timeout_s} on row {row}"
                    first_error = first_error or msg
                    self._abandon(worker, row)
                    self._fail_or_count(msg, None)
                    scores.append(0.0)
                    row += 1
                    break  # the rest goes to a fresh worker
                row += 1
                score, extras = _split(value) if ok else (None, {})
                if score is not None:
                    scores.append(score)
                    for k, x in extras.items():
                        acc = extra.setdefault(k, [0.0, 0])
                        acc[0] += x
                        acc[1] += 1
                    continue
                errors += 1
                cause = value if not ok else None
                what = (f"{type(value).__name__}: {value}" if not ok
                        else f"returned {value!r}, expected a finite float or a dict with a finite 'score'")
                msg = f"reward {self.name!r} failed on row {row - 1}: {what}"
                first_error = first_error or msg
                fail = self.on_error == "fail" or isinstance(cause, RewardContractError)
                if fail:  # rows still queued on this worker must not reach the next call
                    worker.cancelled = True
                    worker.inbox.put(_STOP)
                    self._worker = None
                    raise RewardError(msg) from cause
                scores.append(0.0)
        stats = {"rows": len(scores), "errors": errors, "timeouts": timeouts, "hung": self.num_hung,
                 "first_error": first_error, "extra": extra}
        return scores, stats

    def close(self) -> None:
        """Stop the idle worker thread (hung ones stop when their call returns)."""
        if self._worker is not None:
            self._worker.inbox.put(_STOP)
            self._worker = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
