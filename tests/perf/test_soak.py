"""The soak script's pure parts (perf/soak.py): /proc parsing, slopes, windows, per-process verdicts,
TQ and log checks.

No training run: each test takes well under a second.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "perf" / "soak.py"
_spec = importlib.util.spec_from_file_location("perf_soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = soak
_spec.loader.exec_module(soak)

STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
VmPeak:\t  900000 kB
VmRSS:\t  474140 kB
RssAnon:\t  300000 kB
RssFile:\t  174140 kB
Threads:\t27
"""


def test_status_fields_in_kb():
    assert soak.parse_status_kb(STATUS) == 474140
    assert soak.parse_status_kb(STATUS, "RssAnon") == 300000
    assert soak.parse_status_kb("Name:\tzombie\nState:\tZ (zombie)\n") is None  # no VmRSS


def test_status_with_an_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="unit"):
        soak.parse_status_kb("VmRSS:\t 12 MB\n")


def test_stat_counts_fields_after_the_command_name():
    # a command name with spaces and a ')' must not shift the fields
    fields = ["S", "4482"] + [str(i) for i in range(5, 22)] + ["987654"] + ["0"] * 30
    line = "4545 (weird) name) " + " ".join(fields)
    assert soak.parse_stat(line) == (4482, 987654)
    with pytest.raises(ValueError):
        soak.parse_stat("garbage")


def test_descendants_walks_the_tree_parents_first():
    ppids = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert soak.descendants(ppids, 10) == [10, 11, 12, 13]
    assert soak.descendants(ppids, 21) == [21]


def test_labels_from_command_lines():
    py = "/venv/bin/python -B -c"
    assert soak.label_for("python -m asyncflow.cli train", True) == "launcher"
    assert soak.label_for(f"{py} from multiprocessing.resource_tracker import main;main(26)", False) \
        == "resource_tracker"
    assert soak.label_for(f"{py} from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=27, "
                          "pipe_handle=31) --multiprocessing-fork", False) == "rank"
    assert soak.label_for("/usr/bin/sleep 5", False) == "sleep"
    assert soak.label_for("/venv/bin/python -m asyncflow.transfer_queue.service_process --host 127.0.0.1",
                          False) == "tq_service"


def test_sampler_reads_this_process():
    s = soak.Sampler(os.getpid()).sample()
    me = s[os.getpid()]
    assert me["label"] == "launcher" and me["rss_kb"] > 1000 and me["anon_kb"] is not None


def test_slope_of_a_line_and_degenerate_inputs():
    ts = [0.0, 10.0, 20.0, 30.0]
    assert soak.slope(ts, [5 + 2 * t for t in ts]) == pytest.approx(2.0)
    assert soak.slope(ts, [1.0, 3.0, 1.0, 3.0]) == pytest.approx(0.04)  # least squares, not end minus start
    assert soak.slope([1.0], [1.0]) is None
    assert soak.slope([2.0, 2.0], [1.0, 5.0]) is None
    with pytest.raises(ValueError):
        soak.slope([1.0, 2.0], [1.0])


def test_kb_per_s_to_mb_per_h():
    assert soak.kb_per_s_to_mb_per_h(1024 / 3600) == pytest.approx(1.0)
    assert soak.kb_per_s_to_mb_per_h(None) is None


METRICS = [
    {"step": 5, "time_s": 5.7, "sft/loss": 3.4, "phase": "sft"},
    {"step": 10, "time_s": 6.1, "eval/accuracy": 0.2, "phase": "sft"},
    {"step": 0, "time_s": 6.2, "eval/accuracy": 0.2, "phase": "before_rl"},
    {"step": 1, "time_s": 6.7, "step_time_s": 0.5, "tq/rows_held": 256.0, "tq/bytes_held": 1000.0},
    {"step": 2, "time_s": 7.2, "step_time_s": 0.5, "tq/rows_held": 512.0, "tq/bytes_held": 2000.0},
    {"step": 2, "time_s": 7.3, "eval/accuracy": 0.3, "phase": "rl"},
    {"step": 3, "time_s": 7.7, "step_time_s": 0.5, "tq/rows_held": 256.0, "tq/bytes_held": 1000.0},
    {"step": 4, "time_s": 8.2, "step_time_s": 0.5, "tq/rows_held": 0.0, "tq/bytes_held": 0.0},
    {"step": 4, "time_s": 8.5, "eval/accuracy": 0.3, "phase": "after_rl"},
]


def test_rl_window_from_before_rl_to_the_last_step():
    assert soak.rl_window(METRICS) == (6.2, 8.2, 4)
    no_eval = [m for m in METRICS if m.get("phase") != "before_rl"]
    start, end, steps = soak.rl_window(no_eval)
    assert start == pytest.approx(6.2) and end == 8.2 and steps == 4  # first step less its step time
    assert soak.rl_window(METRICS[:2]) == (None, None, 0)


def test_clock_offset_is_the_smallest_lag():
    # metrics time_s = sampler t - 3.0 at best; later reads only lag more
    assert soak.clock_offset([(1.0, None), (5.0, 1.5), (6.0, 3.0), (7.0, 3.2)]) == pytest.approx(3.0)
    assert soak.clock_offset([(1.0, None)]) is None


def _samples(n: int, grow_kb_per_s: float, extra_from: int | None = None) -> list[dict]:
    out = []
    for i in range(n):
        t = 10.0 * i
        procs = {"100": {"label": "launcher", "rss_kb": 200_000, "anon_kb": 150_000},
                 "101": {"label": "rank0", "rss_kb": 400_000 + grow_kb_per_s * t,
                         "anon_kb": 300_000 + grow_kb_per_s * t}}
        if extra_from is not None and i >= extra_from:
            procs["102"] = {"label": "sleep", "rss_kb": 50_000, "anon_kb": None}
        out.append({"t_s": t, "metrics_time_s": None, "procs": procs})
    return out


MB_PER_H = 1024 / 3600  # kB/s


def _two_ranks(n: int, rank0_mb_per_h: float, rank1_mb_per_h: float) -> list[dict]:
    """rank0 and rank1 on straight lines, a flat launcher, one sample every 10 s."""
    out = []
    for i in range(n):
        t = 10.0 * i
        out.append({"t_s": t, "metrics_time_s": None, "procs": {
            "100": {"label": "launcher", "rss_kb": 200_000, "anon_kb": 150_000},
            "101": {"label": "rank0", "rss_kb": 500_000 + rank0_mb_per_h * MB_PER_H * t, "anon_kb": None},
            "102": {"label": "rank1", "rss_kb": 400_000 + rank1_mb_per_h * MB_PER_H * t, "anon_kb": None}}})
    return out


def _flat_then_climbing(n: int, late_mb_per_h: float) -> list[dict]:
    """rank0 flat for the first half of n samples (10 s apart), then climbing at
    ``late_mb_per_h``: over the whole span its least-squares slope is half the late one."""
    samples = _two_ranks(n, 0.0, 0.0)
    half_t = 10.0 * (n - 1) / 2
    for s in samples:
        s["procs"]["101"]["rss_kb"] += late_mb_per_h * MB_PER_H * max(0.0, s["t_s"] - half_t)
    return samples


def test_a_process_flat_then_climbing_in_the_last_half_fails():
    samples = _flat_then_climbing(41, 30.0)  # 0..400 s, climbing from 200 s
    whole = soak.fit_memory(samples, 0.0, 400.0)
    late = soak.fit_memory(samples, 200.0, 400.0, names=soak.stable_names(samples))
    assert whole["processes"]["rank0"].slope_mb_per_h == pytest.approx(15.0, rel=0.05)
    assert whole["processes"]["rank0"].verdict == "pass"  # the whole window alone would pass it
    assert late["processes"]["rank0"].slope_mb_per_h == pytest.approx(30.0)
    judged = soak.judge_with_last_half(whole, late)
    rank0 = judged["processes"]["rank0"]
    assert rank0.verdict == "FAIL" and rank0.why.startswith("last half of the window: 30.0 >= 20")
    assert rank0.slope_mb_per_h == whole["processes"]["rank0"].slope_mb_per_h  # the whole window's slope stays
    assert judged["processes"]["rank1"].verdict == judged["processes"]["launcher"].verdict == "pass"
    v = judged["verdict"]
    assert v.verdict == "FAIL" and not v.met and v.failing == ["rank0"]


def test_the_last_half_rule_passes_what_both_windows_pass_and_keeps_a_whole_window_failure():
    flat = _flat_then_climbing(41, 10.0)  # 5 MB/hour over the whole, 10 over the last half
    names = soak.stable_names(flat)
    judged = soak.judge_with_last_half(soak.fit_memory(flat, 0.0, 400.0),
                                       soak.fit_memory(flat, 200.0, 400.0, names=names))
    assert judged["verdict"].verdict == "pass" and judged["verdict"].failing == []
    # a climb early in the window, flat later: the whole window's failure stands
    early = _two_ranks(41, 0.0, 0.0)
    for s in early:
        s["procs"]["101"]["rss_kb"] += 60.0 * MB_PER_H * min(s["t_s"], 200.0)
    judged = soak.judge_with_last_half(soak.fit_memory(early, 0.0, 400.0),
                                       soak.fit_memory(early, 200.0, 400.0, names=names))
    assert judged["processes"]["rank0"].verdict == "FAIL" and "last half" not in judged["processes"]["rank0"].why
    # too few samples in the last half: judged on the whole window alone
    late = soak.fit_memory(flat, 395.0, 400.0, names=names)
    assert late["processes"]["rank0"].verdict == "not judged"
    assert soak.judge_with_last_half(soak.fit_memory(flat, 0.0, 400.0), late)["verdict"].verdict == "pass"


def test_fit_memory_per_process_and_total():
    fit = soak.fit_memory(_samples(20, 10 * MB_PER_H), 30.0, 150.0)
    assert fit["samples"] == 13
    assert fit["total"] == pytest.approx(10.0)
    assert fit["total_anon"] == pytest.approx(10.0)
    rank0, launcher = fit["processes"]["rank0"], fit["processes"]["launcher"]
    assert rank0.slope_mb_per_h == pytest.approx(10.0) and rank0.pid == 101
    assert (rank0.t_from, rank0.t_to, rank0.samples) == (30.0, 150.0, 13)
    assert launcher.slope_mb_per_h == pytest.approx(0.0)
    assert rank0.verdict == launcher.verdict == "pass"
    assert fit["verdict"].verdict == "pass" and fit["verdict"].met
    assert fit["partial"] == []


def test_one_climbing_process_beside_one_shrinking_fails_though_the_sum_is_flat():
    fit = soak.fit_memory(_two_ranks(40, 30.0, -30.0), 0.0, 390.0)
    assert fit["total"] == pytest.approx(0.0, abs=1e-6)  # the old verdict on the sum would pass this
    assert fit["processes"]["rank0"].slope_mb_per_h == pytest.approx(30.0)
    assert fit["processes"]["rank1"].slope_mb_per_h == pytest.approx(-30.0)
    assert fit["processes"]["rank0"].verdict == "FAIL"
    assert fit["processes"]["rank1"].verdict == "pass"
    v = fit["verdict"]
    assert v.verdict == "FAIL" and not v.met and v.failing == ["rank0"]


def test_the_target_is_strict_and_settable():
    fit = soak.fit_memory(_two_ranks(40, 19.0, 0.0), 0.0, 390.0)
    assert fit["verdict"].verdict == "pass"  # 19 < 20 MB/hour by default
    assert soak.TARGET_MB_PER_H == 20.0
    rank0 = soak.fit_memory(_two_ranks(40, 0.0, 0.0), 0.0, 390.0)["processes"]["rank0"]
    at = soak.judge(dataclasses.replace(rank0, slope_mb_per_h=20.0), (0.0, 390.0), 20.0)
    assert at.verdict == "FAIL"  # reaching the target is not under it
    assert soak.judge(dataclasses.replace(rank0, slope_mb_per_h=19.99), (0.0, 390.0), 20.0).verdict == "pass"
    strict = soak.fit_memory(_two_ranks(40, 19.0, 0.0), 0.0, 390.0, target=10.0)
    assert strict["verdict"].failing == ["rank0"]


def test_fit_memory_leaves_out_a_process_that_starts_inside_the_window():
    fit = soak.fit_memory(_samples(20, 0.0, extra_from=10), 0.0, 190.0)
    assert fit["total"] == pytest.approx(0.0)  # its 50 MB appearing is not a leak
    assert fit["partial"] == ["sleep"]
    sleep = fit["processes"]["sleep"]  # fitted over its own samples, on 90 of the window's 190 s
    assert (sleep.t_from, sleep.t_to, sleep.samples) == (100.0, 190.0, 10)
    assert sleep.verdict == "not judged" and "of" in sleep.why
    assert fit["verdict"].verdict == "pass" and fit["verdict"].not_judged == ["sleep"]


def test_a_short_lived_process_ramping_up_is_not_judged():
    samples = _samples(20, 0.0)
    for i, s in enumerate(samples[15:]):  # 40 s, loading 100 MB: thousands of MB/hour
        s["procs"]["103"] = {"label": "compile", "rss_kb": 20_000 + 25_000 * i, "anon_kb": None}
    fit = soak.fit_memory(samples, 0.0, 190.0)
    assert fit["processes"]["compile"].slope_mb_per_h > 1000
    assert fit["processes"]["compile"].verdict == "not judged"
    assert fit["verdict"].verdict == "pass"


def test_fit_memory_with_too_few_samples():
    fit = soak.fit_memory(_samples(3, 0.0), 100.0, 200.0)
    assert fit["total"] is None and fit["samples"] == 0 and fit["processes"] == {}
    assert fit["verdict"].verdict == "not judged" and not fit["verdict"].met
    one = soak.fit_memory(_samples(3, 0.0), 15.0, 25.0)  # a single sample: no slope
    assert one["processes"]["rank0"].slope_mb_per_h is None
    assert one["verdict"].verdict == "not judged"


def test_stable_names_number_a_label_held_twice():
    samples = _samples(4, 0.0)
    samples[2]["procs"]["205"] = {"label": "rank0", "rss_kb": 1, "anon_kb": None}  # a restarted rank 0
    assert soak.stable_names(samples) == {"100": "launcher", "101": "rank0", "205": "rank0#2"}


def test_rl_end_is_the_last_sample_that_had_not_seen_the_last_step_row():
    samples = [{"t_s": t, "metrics_time_s": m, "procs": {}}
               for t, m in [(0.0, None), (2.0, 1.0), (4.0, 3.0), (6.0, 5.0), (8.0, 5.0), (10.0, 9.0)]]
    # the last RL step row has time_s 5.0: the samples at 6 s and 8 s had already read it
    assert soak.rl_end_sample_time(samples, 5.0) == 4.0
    assert soak.rl_end_sample_time(samples, 0.5) is None


def test_fit_window_ends_with_rl_and_keeps_the_settle():
    samples = [{"t_s": float(t), "metrics_time_s": None if t < 12 else float(min(t - 2, 110)), "procs": {}}
               for t in range(0, 150, 2)]
    # RL from metrics 10 s (sampler 12 s) to its last step row at 110 s: the last sample
    # before that row was read is at 110 s (it had seen 108 s)
    a, b, notes = soak.fit_window(samples, 2.0, 10.0, 110.0, 0.2)
    assert b == 110.0 and a == pytest.approx(12.0 + 0.2 * (110.0 - 12.0)) and notes == []
    a, b, notes = soak.fit_window(samples, None, None, None, 0.2)
    assert (a, b) == (pytest.approx(0.2 * 148.0), 148.0) and "RL start not found" in notes[0]


def test_final_evaluation_after_rl_stays_out_of_the_fit():
    # flat during RL, then the final evaluation and export take 300 MB on rank 0
    samples = _two_ranks(40, 0.0, 0.0)
    for s in samples:
        s["metrics_time_s"] = min(s["t_s"], 300.0)  # the last RL step row at 300 s, no newer row
        if s["t_s"] > 300.0:
            s["procs"]["101"]["rss_kb"] += 300 * 1024
    a, b, _ = soak.fit_window(samples, 0.0, 0.0, 300.0, 0.2)
    assert b == 290.0  # the sample at 300 s had read the last step row already
    assert soak.fit_memory(samples, a, b)["verdict"].verdict == "pass"
    # the old end (the last row's time through the offset) would take in nothing more, but
    # a window running past RL would judge the export as a leak
    assert soak.fit_memory(samples, a, 390.0)["verdict"].failing == ["rank0"]


def test_tq_rows_bounded():
    tq = soak.tq_figures(METRICS, 256)
    assert tq["logged"] and tq["bounded"]
    assert (tq["rows_held_max"], tq["rows_held_final"], tq["bytes_held_max"]) == (512.0, 0.0, 2000.0)
    assert tq["rows_held_max_in_steps"] == pytest.approx(2.0)


def test_tq_rows_growing():
    grow = [{"step": i, "time_s": float(i), "tq/rows_held": 256.0 * i} for i in range(1, 11)]
    tq = soak.tq_figures(grow, 256)
    assert not tq["bounded"]
    assert tq["rows_held_slope_per_1000_steps"] == pytest.approx(256_000.0)


def test_tq_metric_absent_is_said_not_invented():
    tq = soak.tq_figures([m for m in METRICS if "tq/rows_held" not in m] + [{"step": 1, "time_s": 1.0}], 256)
    assert tq == {"logged": False, "note": tq["note"]}
    assert "no tq/rows_held" in tq["note"] and "not measured" in tq["note"]


LOG = """2026-12-01 11:30:29,694 asyncflow.metrics: step 239 | phase after_rl | eval_acc 0 | 36.5s
Traceback (most recent call last):
  File "x.py", line 1, in <module>
    raise RuntimeError("boom")

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "y.py", line 2, in <module>
RuntimeError: boom
2026-12-01 11:30:30 asyncflow.trainer: ERROR something broke
ValueError: bad value
asyncflow run failed:
reward/errors 0 | filtered 3
"""


def test_scan_log_counts_tracebacks_and_error_lines():
    r = soak.scan_log(LOG)
    assert r["tracebacks"] == 2
    assert r["error_lines"] == 3  # ERROR, a bare exception line, the launcher's failure line
    assert "RuntimeError: boom" in r["examples"]
    assert soak.scan_log("step 1 | reward 0.5\nall good\n") == {"tracebacks": 0, "error_lines": 0, "examples": []}


def test_count_errors():
    clean = {"tracebacks": 0, "error_lines": 0}
    assert soak.count_errors(0, [clean, clean], {"reward/errors": 0.0, "reward/timeouts": 0.0}) == 0
    assert soak.count_errors(1, [{"tracebacks": 1, "error_lines": 2}, clean], {"reward/timeouts": 3.0}) == 7
    assert soak.count_errors(0, [], {}) == 0


def test_newest_time_s_reads_only_complete_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    state: dict = {}
    assert soak.newest_time_s(p, state) is None
    p.write_text(json.dumps({"step": 1, "time_s": 2.5}) + "\n" + '{"step": 2, "time_s": 9')
    assert soak.newest_time_s(p, state) == 2.5  # the cut-off line waits
    with open(p, "a") as f:
        f.write('.0}\n{"step": 3, "time_s": 4.0}\n')
    assert soak.newest_time_s(p, state) == 9.0


def test_record_appends_a_section(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Other\n\ntext\n")
    fit = soak.fit_memory(_samples(20, 0.0), 0.0, 190.0)
    an = {"memory": fit, "memory_last_half": fit, "tq": soak.tq_figures(METRICS, 256), "window": [0.0, 190.0],
          "settle": 0.2, "steps": 4, "errors": 0, "rc": 0, "logs": {"stdout": {"tracebacks": 0, "error_lines": 0}},
          "reward_errors": 0.0, "reward_timeouts": 0.0, "notes": []}
    soak.record(an, "python perf/soak.py --quick", 3, 2, path=md)
    text = md.read_text()
    assert text.startswith("# Benchmark results\n\n## Other\n\ntext\n\n## Soak (`perf/soak.py`)")
    assert "| rank0 (pid 101) | - | 0.0-3.2 |" in text and "| pass |" in text
    assert "| sum (not judged) |" in text
    assert "every process under 20 MB/hour over the fit window and over its last half): pass" in text
    assert "bounded" in text and "`python perf/soak.py --quick`" in text
    fail = soak.fit_memory(_two_ranks(20, 30.0, -30.0), 0.0, 190.0)
    soak.record({**an, "memory": fail, "memory_last_half": fail}, "x", 3, 2, path=md)
    assert "over its last half): **FAIL** (rank0)" in md.read_text()


def test_rank_labels_from_ranks_json():
    samples = _samples(2, 0.0)
    soak.relabel_ranks(samples, [{"rank": 0, "host": "vm", "pid": 101, "roles": ["actor", "reward"]},
                                 {"rank": 1, "host": "vm", "pid": 999, "roles": ["rollout0"]}])
    assert [s["procs"]["101"]["label"] for s in samples] == ["rank0"] * 2  # the same name in every run
    assert samples[0]["procs"]["101"]["roles"] == "actor,reward"
    assert samples[0]["procs"]["100"]["label"] == "launcher"
    fit = soak.fit_memory(samples, 0.0, 10.0)["processes"]
    assert set(fit) == {"launcher", "rank0"} and fit["rank0"].roles == "actor,reward"


def test_newest_time_s_after_the_file_is_rewritten(tmp_path):
    p = tmp_path / "metrics.jsonl"
    state: dict = {}
    p.write_text("".join(json.dumps({"step": i, "time_s": float(i)}) + "\n" for i in range(50)))
    assert soak.newest_time_s(p, state) == 49.0
    p.write_text(json.dumps({"step": 1, "time_s": 60.0}) + "\n")  # shorter than what was read
    assert soak.newest_time_s(p, state) == 60.0


def _soak_dir(tmp_path: Path, rank0_mb_per_h: float, rank1_mb_per_h: float) -> Path:
    """A soak's files without a run: samples on the sampler's clock, metrics 5 s behind it;
    RL steps to metrics 185 s, then the final evaluation (row at 215 s) and export take
    300 MB on rank 0."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "time_s": 15.0, "eval/accuracy": 0.2, "phase": "before_rl"}]
    rows += [{"step": i, "time_s": 15.0 + 10 * i, "step_time_s": 1.0, "tq/rows_held": 256.0, "tq/bytes_held": 9.0}
             for i in range(1, 18)]
    rows += [{"step": 17, "time_s": 215.0, "eval/accuracy": 0.3, "phase": "after_rl"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"rl_steps": 17, "reward/errors": 0.0, "reward/timeouts": 0.0}))
    (run / "config.json").write_text(json.dumps({"trainer": {"prompts_per_step": 32, "time_budget_s": 180},
                                                 "rollout": {"n": 8}}))
    (run / "ranks.json").write_text(json.dumps([{"rank": 0, "pid": 101, "roles": ["actor", "reward"]},
                                                {"rank": 1, "pid": 102, "roles": ["rollout0"]}]))
    samples = _two_ranks(25, rank0_mb_per_h, rank1_mb_per_h)
    for s in samples:
        s["metrics_time_s"] = max([r["time_s"] for r in rows if r["time_s"] <= s["t_s"] - 5.0], default=None)
        if s["t_s"] > 190.0:
            s["procs"]["101"]["rss_kb"] += 300 * 1024
    (tmp_path / "rss.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp_path / "train.stdout.log").write_text("")
    (tmp_path / "train.stderr.log").write_text("step 1 | reward 0.5\n")
    (tmp_path / "run.json").write_text(json.dumps({"rc": 0, "killed": None, "wall_s": 250.0, "minutes": 3,
                                                   "interval": 10, "settle": 0.2, "cmd_line": "python perf/soak.py"}))
    return tmp_path


def test_reanalyse_an_out_dir_ends_with_the_json_line(tmp_path, capsys):
    assert soak.reanalyse(_soak_dir(tmp_path, 10.0, 0.0), None, record_it=False) == 0
    printed = capsys.readouterr().out
    last = json.loads(printed.strip().splitlines()[-1])
    assert last["verdict"] == "pass" and last["target_met"] is True and last["failing"] == []
    assert last["target_mb_per_h"] == 20.0
    assert set(last["processes"]) == {"launcher", "rank0", "rank1"}
    rank0 = last["processes"]["rank0"]
    assert rank0["slope_mb_per_h"] == pytest.approx(10.0) and rank0["verdict"] == "pass"
    assert rank0["slope_mb_per_h_last_half"] == pytest.approx(10.0)
    assert rank0["roles"] == "actor,reward" and rank0["pid"] == 101
    # RL from t = 20 s (before_rl at 15 s, plus the 5 s offset) to the last sample before the
    # last step row (185 s) was read: 180 s. The first 20% settles: the fit starts at 52 s, so
    # its first sample is at 60 s. The export's 300 MB after 190 s stays out.
    assert last["fit_window_min"] == [pytest.approx(52 / 60, abs=0.01), pytest.approx(180 / 60, abs=0.01)]
    assert rank0["window_min"] == [pytest.approx(1.0), pytest.approx(3.0)]
    assert last["steps"] == 17 and last["errors"] == 0
    assert last["tq_rows_held_max"] == 256.0 and last["tq_rows_bounded"] is True
    assert "memory verdict: pass (every process under 20 MB/hour over the window and its last half)" in printed
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["analysis"]["memory"]["processes"]["rank0"]["verdict"] == "pass"


def test_reanalyse_fails_a_climb_that_starts_halfway(tmp_path, capsys):
    """rank0 flat, then climbing at 30 MB/hour from the middle of the fit window (52-180 s):
    about 15 MB/hour over the window, 30 over its last half: the soak fails."""
    out = _soak_dir(tmp_path, 0.0, 0.0)
    samples = [json.loads(line) for line in (out / "rss.jsonl").read_text().splitlines()]
    for s in samples:
        s["procs"]["101"]["rss_kb"] += 30.0 * MB_PER_H * max(0.0, s["t_s"] - 116.0)
    (out / "rss.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert soak.reanalyse(out, None, record_it=False) == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rank0 = last["processes"]["rank0"]
    assert rank0["slope_mb_per_h"] < 20.0 <= rank0["slope_mb_per_h_last_half"]
    assert rank0["verdict"] == "FAIL" and rank0["verdict_last_half"] == "FAIL"
    assert last["verdict"] == "FAIL" and last["failing"] == ["rank0"]


def test_reanalyse_fails_a_climb_hidden_in_a_flat_sum(tmp_path, capsys):
    assert soak.reanalyse(_soak_dir(tmp_path, 30.0, -30.0), None, record_it=False) == 1
    printed = capsys.readouterr().out
    last = json.loads(printed.strip().splitlines()[-1])
    assert last["sum_slope_mb_per_h"] == pytest.approx(0.0, abs=1e-6)
    assert last["verdict"] == "FAIL" and last["target_met"] is False and last["failing"] == ["rank0"]
    assert last["processes"]["rank0"]["verdict"] == "FAIL"
    assert last["processes"]["rank1"]["verdict"] == "pass"
    assert "memory verdict: FAIL (every process under 20 MB/hour over the window and its last half; " \
           "failing: rank0)" in printed
    # a laxer target passes the same files
    assert soak.reanalyse(tmp_path, None, record_it=False, target=40.0) == 0
