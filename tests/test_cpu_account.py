"""asyncflow.cpu_account: exclusive spans per thread, the snapshot file, and no cost when off."""
from __future__ import annotations

import json
import os
import threading

import pytest

from asyncflow import cpu_account
from asyncflow.cpu_account import CpuAccount


def _burn(ns: int) -> None:
    """Spend at least ``ns`` of this thread's CPU time."""
    import time
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


def test_an_inner_span_takes_its_time_out_of_the_outer_one(tmp_path):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)
    with acct.span("rpc"):
        _burn(2_000_000)
        with acct.span("serialization"):
            _burn(5_000_000)
        assert acct.current() == "rpc"
    assert acct.current() is None
    totals = acct.snapshot()["spans"][str(threading.get_native_id())]
    assert totals["serialization"] >= 5_000_000
    # the outer span holds only its own time: what it burnt itself, not the inner 5 ms
    assert 2_000_000 <= totals["rpc"] < totals["serialization"]


def test_each_thread_has_its_own_book_and_name(tmp_path):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)

    def work() -> None:
        with acct.span("generation"):
            _burn(1_000_000)

    t = threading.Thread(target=work, name="rollout-rank1-service")
    t.start()
    t.join()
    with acct.span("driver"):
        pass
    snap = acct.snapshot()
    assert snap["threads"][str(t.native_id)] == "rollout-rank1-service"  # kept after the thread ended
    assert set(snap["spans"][str(t.native_id)]) == {"generation"}
    assert set(snap["spans"][str(threading.get_native_id())]) == {"driver"}


def test_the_snapshot_file_is_written_when_a_span_ends_after_the_interval(tmp_path):
    acct = CpuAccount(str(tmp_path), dump_interval_s=0.0)
    with acct.span("logging"):
        pass
    data = json.loads((tmp_path / f"cpu_account-{os.getpid()}.json").read_text())
    assert data["pid"] == os.getpid()
    assert "logging" in data["spans"][str(threading.get_native_id())]
    assert not list(tmp_path.glob("*.tmp"))  # written beside, then renamed over


def test_off_the_decorator_returns_the_function_itself(monkeypatch):
    monkeypatch.setattr(cpu_account, "ACCOUNT", None)

    def f(x: int) -> int:
        return x + 1

    assert cpu_account.charged("rpc")(f) is f
    assert cpu_account.span("rpc") is cpu_account._OFF
    assert not cpu_account.enabled()


def test_on_the_decorator_charges_the_call_and_keeps_the_name(tmp_path, monkeypatch):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)
    monkeypatch.setattr(cpu_account, "ACCOUNT", acct)

    @cpu_account.charged("tq_client")
    def put(ns: int) -> str:
        _burn(ns)
        return "done"

    assert put(1_000_000) == "done"
    assert put.__name__ == "put"
    assert acct.snapshot()["spans"][str(threading.get_native_id())]["tq_client"] >= 1_000_000


def test_a_span_that_raises_is_still_closed(tmp_path):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)
    with pytest.raises(ValueError), acct.span("update"):
        raise ValueError("boom")
    assert acct.current() is None
    assert "update" in acct.snapshot()["spans"][str(threading.get_native_id())]


def test_counts_of_every_thread_add_up_in_the_snapshot(tmp_path, monkeypatch):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)
    monkeypatch.setattr(cpu_account, "ACCOUNT", acct)
    cpu_account.count("tq-controller:get_meta")
    t = threading.Thread(target=lambda: [cpu_account.count("tq-controller:get_meta") for _ in range(2)])
    t.start()
    t.join()
    cpu_account.count("worker-0:call")
    assert acct.snapshot()["counts"] == {"tq-controller:get_meta": 3, "worker-0:call": 1}


def test_a_snapshot_counts_the_open_spans_up_to_now_each_exclusive(tmp_path):
    acct = CpuAccount(str(tmp_path), dump_interval_s=3600)
    me = str(threading.get_native_id())
    with acct.span("update"):
        _burn(3_000_000)
        with acct.span("tq_client"):
            _burn(4_000_000)
            snap = acct.snapshot()  # both spans still open
    spans, cpu = snap["spans"][me], snap["cpu"][me]
    assert 3_000_000 <= spans["update"] < 4_000_000 <= spans["tq_client"]
    assert cpu >= spans["update"] + spans["tq_client"]  # the thread's clock, read at the same moment
    after = acct.snapshot()["spans"][me]
    assert after["tq_client"] >= spans["tq_client"] and after["update"] >= spans["update"]
