"""Timeline: which worker ran which stage when, one span per line of `timeline.jsonl`.

A span is `{"lane": "rank0 actor", "stage": "update", "start": 1.25, "end": 2.5, ...info}`
with times in seconds since the timeline's t0. Many asyncio tasks and threads record at
once, so records go through a lock into a buffer that is written every `flush_every`
records or `flush_interval_s` seconds (checked on each record) and on `flush()`/`close()`:
cheap enough to record every stage of every step, and a crash loses only the last few.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncflow.cpu_account import charged
from asyncflow.metrics.logger import to_plain

TIMELINE_FILE = "timeline.jsonl"
SPAN_KEYS = ("lane", "stage", "start", "end")


@dataclass(frozen=True)
class Span:
    lane: str
    stage: str
    start: float
    end: float
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = [k for k in SPAN_KEYS if k in self.info]
        if clash:  # info sits beside the span keys on disk, so it cannot reuse their names
            raise ValueError(f"span {self.lane!r}/{self.stage!r}: info keys {clash} are reserved")

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        # info is flat beside the span keys so that `jq 'select(.step == 3)'` just works
        return {"lane": self.lane, "stage": self.stage, "start": round(self.start, 6),
                "end": round(self.end, 6), **self.info}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Span:
        """The span of a `timeline.jsonl` row; ValueError names what is missing or wrong."""
        missing = [k for k in SPAN_KEYS if k not in row]
        if missing:
            raise ValueError(f"span is missing {missing}")
        lane, stage, start, end = (row[k] for k in SPAN_KEYS)
        if not isinstance(lane, str) or not isinstance(stage, str):
            raise ValueError(f"span lane and stage must be strings, got {lane!r}, {stage!r}")
        if isinstance(start, bool) or isinstance(end, bool) or \
                not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
            raise ValueError(f"span start and end must be numbers, got {start!r}, {end!r}")
        if end < start:
            raise ValueError(f"span ends before it starts: start={start}, end={end}")
        info = {k: v for k, v in row.items() if k not in SPAN_KEYS}
        return cls(lane, stage, float(start), float(end), info)


def as_span(span: Span | Mapping[str, Any]) -> Span:
    """Accept both Span objects and the dicts read back from `timeline.jsonl`."""
    return span if isinstance(span, Span) else Span.from_dict(span)


class Timeline:
    """Records spans into `out_dir/timeline.jsonl` (truncated at construction).

    `t0` is a `time.perf_counter()` value; share it with MetricsLogger(t0=...) so that the
    metrics' `time_s` and the spans use the same clock.
    """

    def __init__(self, out_dir: str | Path, *, t0: float | None = None,
                 flush_every: int = 256, flush_interval_s: float = 5.0):
        if flush_every < 1:
            raise ValueError(f"Timeline(flush_every={flush_every}): must be at least 1")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / TIMELINE_FILE
        self.t0 = time.perf_counter() if t0 is None else t0
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        self._file = self.path.open("w", encoding="utf-8")

    def now(self) -> float:
        """Seconds since t0: the clock that `record`'s start and end are on."""
        return time.perf_counter() - self.t0

    @charged("logging")
    def record(self, lane: str, stage: str, start: float, end: float, **info: Any) -> Span:
        """Record that `lane` ran `stage` from `start` to `end` (seconds since t0)."""
        if end < start:
            raise ValueError(f"Timeline.record({lane!r}, {stage!r}): end {end} is before start {start}")
        span = Span(lane, stage, float(start), float(end),
                    {k: to_plain(k, v) for k, v in info.items()})
        line = json.dumps(span.to_dict())  # serialise outside the lock: threads do it in parallel
        with self._lock:
            if self._file.closed:
                raise RuntimeError(f"Timeline for {self.path} is closed")
            self._buffer.append(line)
            if (len(self._buffer) >= self.flush_every
                    or time.monotonic() - self._last_flush >= self.flush_interval_s):
                self._flush_locked()
        return span

    @contextmanager
    def span(self, lane: str, stage: str, **info: Any) -> Iterator[dict[str, Any]]:
        """Time the `with` body as one span. The yielded dict is the span's info, so the body
        can add what it learns (`info["tokens"] = n`). A body that raises is still recorded,
        with `error` set to the exception's type."""
        start = self.now()
        details = dict(info)
        try:
            yield details
        except BaseException as exc:
            details["error"] = type(exc).__name__
            raise
        finally:
            end = self.now()
            clash = [k for k in SPAN_KEYS if k in details]
            if clash:
                raise ValueError(f"Timeline.span({lane!r}, {stage!r}): info keys {clash} are reserved")
            self.record(lane, stage, start, end, **details)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._buffer:
            self._file.write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flush_locked()
                self._file.close()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
