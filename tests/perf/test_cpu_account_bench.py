"""perf/cpu_account.py's pure parts: which component a thread is, how spans and remainders
add up, the fixed and per-row split, the table."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "perf"))
import cpu_account as bench


@pytest.mark.parametrize("process, thread, component", [
    ("tq_service", "MainThread", "tq_process"),
    ("tq_service", "ZMQbg/IO/0", "tq_process"),  # the TransferQueue's process is one component, its I/O too
    ("rank0", "tq-service", "tq_process"),  # transfer_queue.service=driver: a thread of rank 0
    ("rank2", "tq-unit-1", "tq_process"),  # a node's storage unit (storage_units=per_node)
    ("rank0", "ZMQbg/IO/0", "zmq_io"),
    ("rank0", "MainThread", "driver_loop"),
    ("rank1", "MainThread", "rpc"),  # a worker's call loop: its calls' work is in spans
    ("rank1", "rollout-rank1-service", "generation"),
    ("rank1", "rollout-rank1-writer", "tq_client"),
    ("rank1", "reward-number-1", "reward"),
    ("rank0", "Thread-1 (tensorboard.summary.writer.event_file_writer._AsyncWriterThread)", "logging"),
    ("rank1", "gloo_tcp_loop", "weight_sync"),
    ("trl", "MainThread", "driver_loop"),
    ("rank0", "python", "other"),
])
def test_a_thread_goes_to_the_component_its_name_says(process, thread, component):
    assert bench.thread_component(process, thread) == component


def test_spans_take_their_part_and_the_rest_goes_to_the_thread_s_component():
    threads = {"a": ("rank0", "MainThread", 100.0), "b": ("rank1", "MainThread", 50.0)}
    spans = {"a": {"serialization": 30.0, "logging": 10.0}, "b": {"reward": 45.0}}
    assert bench.attribute(threads, spans) == {"serialization": 30.0, "logging": 10.0, "driver_loop": 60.0,
                                               "reward": 45.0, "rpc": 5.0}


def test_spans_over_their_thread_s_cpu_are_scaled_down_to_it():
    out = bench.attribute({"a": ("rank0", "worker-rank0", 80.0)}, {"a": {"update": 60.0, "rpc": 40.0}})
    assert out == {"update": 48.0, "rpc": 32.0}  # 100 in spans over 80 on CPU: each x 0.8, no remainder


def test_a_snapshot_change_is_scaled_to_the_window():
    assert bench.scale_to_window({"rpc": 10, "logging": 5}, {"rpc": 30, "logging": 5, "update": 4}, 1.5) == \
        {"rpc": 30.0, "update": 6.0}  # logging did not change: left out


def test_per_step_orders_components_and_sums_the_control_plane():
    ms = bench.per_step({"rpc": 4e6, "update": 10e6, "serialization": 2e6, "zzz": 2e6}, steps=2)
    assert list(ms) == ["update", "rpc", "serialization", "zzz", "total", "control_plane"]
    assert ms["total"] == 9.0 and ms["control_plane"] == 3.0


def test_cores_busy_is_cpu_a_step_over_wall_a_step():
    assert bench.cores_busy(120.0, window_s=2.4, steps=40) == pytest.approx(2.0)  # 120 ms of CPU in 60 ms steps
    assert bench.cores_busy(30.0, window_s=2.4, steps=40) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="window of steps"):
        bench.cores_busy(30.0, window_s=0.0, steps=40)


def test_fixed_and_per_row_recovers_a_line():
    fixed, per_row = bench.fixed_and_per_row([(64, 10 + 0.5 * 64), (256, 10 + 0.5 * 256), (1024, 10 + 0.5 * 1024)])
    assert fixed == pytest.approx(10.0) and per_row == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two row counts"):
        bench.fixed_and_per_row([(64, 1.0), (64, 2.0)])


def test_the_table_has_a_row_per_component_and_both_sides():
    text = bench.table({"ours x1": {"update": 6.4, "total": 6.4, "control_plane": 0.0},
                        "trl x1": {"generation": 3.2, "total": 3.2, "control_plane": 0.0}},
                       {"ours x1": 64, "trl x1": 64})
    lines = text.splitlines()
    assert lines[0] == "| component | ours x1 ms/step | ours x1 us/row | trl x1 ms/step | trl x1 us/row |"
    assert "| update | 6.4 | 100 | 0.0 | 0 |" in lines
    assert "| generation | 0.0 | 0 | 3.2 | 50 |" in lines
    assert lines[-1] == "| **total** | 6.4 | 100 | 3.2 | 50 |"


def test_trl_interpreter_makes_bench_e2e_venv_or_says_what_to_do(tmp_path, monkeypatch):
    """No --trl-venv: bench_e2e's venv, made when missing; a failure names the log and --no-trl.
    A --trl-venv without a python is refused by name."""
    made = []
    monkeypatch.setattr(bench.bench_e2e, "ensure_trl_venv", lambda log: made.append(log))
    assert bench.trl_interpreter("", tmp_path) == bench.bench_e2e.trl_python()
    assert made == [tmp_path / "trl_install.log"]
    monkeypatch.setattr(bench.bench_e2e, "ensure_trl_venv", lambda log: "pip failed")
    with pytest.raises(SystemExit, match="could not be made: pip failed .*pass --no-trl"):
        bench.trl_interpreter("", tmp_path)
    with pytest.raises(SystemExit, match="--trl-venv .* has no bin/python"):
        bench.trl_interpreter(str(tmp_path / "nowhere"), tmp_path)
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").write_text("")
    assert bench.trl_interpreter(str(tmp_path / "v"), tmp_path) == tmp_path / "v" / "bin" / "python"


def test_the_default_window_holds_about_the_same_rows_at_every_scale():
    assert bench.window_steps([1, 4, 16], None) == [bench.WINDOW_STEPS_1X, bench.WINDOW_STEPS_1X // 4,
                                                    bench.WINDOW_STEPS_1X // 16]
    assert bench.window_steps([1000], None) == [bench.MIN_WINDOW_STEPS]


def test_a_window_given_is_taken_at_every_scale_or_per_scale():
    assert bench.window_steps([1, 4], 24) == [24, 24]
    assert bench.window_steps([1, 4], 24, "30,10") == [30, 10]


def test_per_scale_windows_must_name_one_per_scale():
    with pytest.raises(ValueError, match="2 windows for 3 scales"):
        bench.window_steps([1, 4, 16], None, "24,12")
