"""Timeline: spans from many threads, the span context manager, periodic flushing."""
from __future__ import annotations

import json
import threading
import time

import pytest

from asyncflow.metrics import Span, Timeline


def _spans(path):
    return [Span.from_dict(json.loads(line)) for line in path.read_text().splitlines()]


def test_spans_from_many_threads_are_all_recorded(tmp_path):
    n_threads, per_thread = 8, 300
    timeline = Timeline(tmp_path, flush_every=7)  # many flushes racing the records
    barrier = threading.Barrier(n_threads)

    def work(k: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            t = timeline.now()
            timeline.record(f"rank{k} actor", "update", t, t + 0.001, step=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    timeline.close()
    spans = _spans(tmp_path / "timeline.jsonl")  # every line parses: no interleaved writes
    assert len(spans) == n_threads * per_thread
    for k in range(n_threads):
        steps = [s.info["step"] for s in spans if s.lane == f"rank{k} actor"]
        assert steps == list(range(per_thread))  # each thread's spans, in its order


def test_span_context_manager_times_the_body_and_takes_info(tmp_path):
    with Timeline(tmp_path) as timeline:
        with timeline.span("driver reward", "reward", step=3, rows=64) as info:
            body_start = timeline.now()
            time.sleep(0.05)
            info["tokens"] = 1000
            body_end = timeline.now()
        with pytest.raises(KeyError):
            with timeline.span("rank0 actor", "update", step=3):
                raise KeyError("boom")
    ok, failed = _spans(tmp_path / "timeline.jsonl")
    assert (ok.lane, ok.stage, ok.info) == ("driver reward", "reward", {"step": 3, "rows": 64, "tokens": 1000})
    # the span holds its whole body (its file keeps microseconds: round as it does)
    assert ok.start <= round(body_start, 6) < round(body_end, 6) <= ok.end
    assert 0 <= ok.start < ok.end <= failed.start
    assert failed.info == {"step": 3, "error": "KeyError"}


def test_flushes_every_n_records_and_after_the_interval(tmp_path):
    timeline = Timeline(tmp_path / "a", flush_every=3, flush_interval_s=3600)
    path = timeline.path
    timeline.record("l", "s", 0.0, 1.0)
    timeline.record("l", "s", 1.0, 2.0)
    assert path.read_text() == ""  # buffered
    timeline.record("l", "s", 2.0, 3.0)
    assert len(path.read_text().splitlines()) == 3
    timeline.record("l", "s", 3.0, 4.0)
    timeline.flush()
    assert len(path.read_text().splitlines()) == 4
    timeline.close()

    timeline = Timeline(tmp_path / "b", flush_every=1000, flush_interval_s=0.0)
    timeline.record("l", "s", 0.0, 1.0)
    assert len(timeline.path.read_text().splitlines()) == 1  # interval passed: written at once
    timeline.close()
    with pytest.raises(RuntimeError, match="closed"):
        timeline.record("l", "s", 0.0, 1.0)


def test_bad_spans_are_refused(tmp_path):
    with Timeline(tmp_path) as timeline:
        with pytest.raises(ValueError, match="before start"):
            timeline.record("rank0 actor", "update", 2.0, 1.0)
        with pytest.raises(ValueError, match="reserved"):
            with timeline.span("rank0 actor", "update") as info:
                info["start"] = 5
    assert (tmp_path / "timeline.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="missing \\['end'\\]"):
        Span.from_dict({"lane": "a", "stage": "b", "start": 1})
    with pytest.raises(ValueError, match="numbers"):
        Span.from_dict({"lane": "a", "stage": "b", "start": "1", "end": 2})
