"""build_report and the JSONL readers: PNGs and trace from a run dir, bad and truncated lines."""
from __future__ import annotations

import json
import logging

import pytest
from _metrics_run import png_size

from asyncflow.metrics import JsonlError, build_report, read_jsonl


def test_report_of_a_synthetic_run(synthetic_run):
    out_dir, n_rows, n_spans = synthetic_run
    assert n_rows > 200 and n_spans > 2000
    paths = build_report(out_dir)
    assert set(paths) == {"training_curves", "throughput", "timeline", "trace"}
    for name in ("training_curves", "throughput", "timeline"):
        assert paths[name] == out_dir / "report" / f"{name}.png"
        width, height = png_size(paths[name])
        assert width > 500 and height > 200
    trace = json.loads(paths["trace"].read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == n_spans
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"rank0 rollout", "rank0 actor", "driver reward"}


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "time_s": 0.1}\n{"step": 1, "time_s": 0.2}\n{"step": 2, "ti')
    with caplog.at_level(logging.WARNING, logger="asyncflow.metrics"):
        rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 1]
    assert any(f"{path}:3: skipping a truncated last line" in r.getMessage() for r in caplog.records)


def test_bad_line_in_the_middle_names_file_and_line(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text('{"lane": "a", "stage": "s", "start": 0, "end": 1}\n\n{"lane": oops}\n'
                    '{"lane": "a", "stage": "s", "start": 1, "end": 2}\n')
    with pytest.raises(JsonlError, match=f"^{path}:3: not valid JSON") as info:
        read_jsonl(path)
    assert info.value.lineno == 3
    # a broken last line that does end in a newline was written whole: corrupt, not truncated
    path.write_text('{"step": 0}\n{"step": \n')
    with pytest.raises(JsonlError, match=":2: not valid JSON"):
        read_jsonl(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(JsonlError, match=":2: expected a JSON object"):
        read_jsonl(path)


def test_bad_rows_name_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"time_s": 1.0}\n')
    with pytest.raises(JsonlError, match="metrics.jsonl:2: metrics row needs an integer 'step'"):
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "timeline.jsonl").write_text('{"lane": "a", "stage": "s", "start": 2, "end": 1}\n')
    with pytest.raises(JsonlError, match="timeline.jsonl:1: span ends before it starts"):
        build_report(tmp_path)


def test_missing_run_or_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_report(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        build_report(tmp_path)


def test_empty_metrics_and_no_timeline_still_give_a_report(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("")
    with caplog.at_level(logging.WARNING, logger="asyncflow.metrics"):
        paths = build_report(tmp_path)
    assert any("timeline.jsonl not found" in r.getMessage() for r in caplog.records)
    for name in ("training_curves", "throughput", "timeline"):
        png_size(paths[name])
    assert [e for e in json.loads(paths["trace"].read_text())["traceEvents"] if e["ph"] == "X"] == []
