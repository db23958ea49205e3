"""Chrome/Perfetto trace export of a run's timeline (open in ui.perfetto.dev or chrome://tracing).

Every span becomes a complete event ("ph": "X") with microsecond `ts`/`dur`; each lane is
one thread of a single process, named by a `thread_name` metadata event, so the viewer
shows one row per worker with the same names as `timeline.png`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncflow.metrics.timeline import Span, as_span

PID = 1
PROCESS_NAME = "asyncflow"


def lane_sort_key(lane: str) -> list[Any]:
    """Natural order, so `rank2` comes before `rank10` in every view of the run."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", lane)]


def chrome_trace_events(spans: Iterable[Span | Mapping[str, Any]]) -> dict[str, Any]:
    """The trace as a JSON-ready dict: `{"traceEvents": [...], "displayTimeUnit": "ms"}`."""
    all_spans = [as_span(s) for s in spans]
    lanes = sorted({s.lane for s in all_spans}, key=lane_sort_key)
    tids = {lane: i + 1 for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": PROCESS_NAME}}]
    for lane, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": lane}})
        # the viewer orders threads by this index, not by name: keep the natural order
        events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in all_spans:
        events.append({"name": s.stage, "cat": s.stage, "ph": "X", "pid": PID, "tid": tids[s.lane],
                       "ts": round(s.start * 1e6, 3), "dur": round(s.duration * 1e6, 3),
                       "args": dict(s.info)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def export_chrome_trace(spans: Iterable[Span | Mapping[str, Any]], path: str | Path) -> Path:
    """Write the spans as a Chrome trace JSON file at `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace_events(spans), separators=(",", ":")), encoding="utf-8")
    return path
