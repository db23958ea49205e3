"""Chrome/Perfetto trace export."""
from __future__ import annotations

import json

from asyncflow.metrics import Span, export_chrome_trace


def test_trace_has_one_named_thread_per_lane_and_exact_durations(tmp_path):
    spans = [
        Span("rank10 actor", "update", 1.5, 2.25, {"step": 1}),
        {"lane": "rank2 actor", "stage": "update", "start": 0.5, "end": 1.0, "step": 1, "rows": 8},
        Span("rank2 actor", "old_log_prob", 0.0, 0.5, {"step": 1}),
        Span("driver reward", "reward", 0.25, 0.75),
    ]
    path = export_chrome_trace(spans, tmp_path / "sub" / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["driver reward", "rank10 actor", "rank2 actor"]
    assert len(set(names)) == 3 and all(e["pid"] == 1 for e in events)
    by_name = {v: k for k, v in names.items()}
    assert by_name["driver reward"] < by_name["rank2 actor"] < by_name["rank10 actor"]  # natural order

    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 4
    update2 = next(e for e in complete if e["tid"] == by_name["rank2 actor"] and e["name"] == "update")
    assert (update2["ts"], update2["dur"]) == (500000, 500000)  # microseconds
    assert update2["args"] == {"step": 1, "rows": 8}
    update10 = next(e for e in complete if e["tid"] == by_name["rank10 actor"])
    assert (update10["ts"], update10["dur"]) == (1500000, 750000)
    assert all(e["tid"] in names for e in complete)
