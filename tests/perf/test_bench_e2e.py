"""perf/bench_e2e.py's pure logic: the rotating order, medians and spreads, the better-of-sync
headline, the bound from stand-alone stage costs, and how generated tokens are counted."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_e2e  # noqa: E402

ROWS = 64
DISAGG = {"mode": "disaggregated", "actor_ranks": [0], "rollout_ranks": [1], "reward_with": "actor"}


# ---- rotation ---------------------------------------------------------------------------------

def test_rotation_starts_each_repetition_one_entry_later():
    assert bench_e2e.rotation(["A", "B", "C", "D"], 3) == [["A", "B", "C", "D"], ["B", "C", "D", "A"],
                                                           ["C", "D", "A", "B"]]


def test_rotation_puts_every_entry_in_every_position_once_per_cycle():
    names = ["sync_colocated", "sync", "stream", "async", "trl"]
    orders = bench_e2e.rotation(names, 5)
    for order in orders:
        assert sorted(order) == sorted(names)
    for pos in range(len(names)):
        assert sorted(o[pos] for o in orders) == sorted(names)
    assert bench_e2e.rotation(names, 7)[5] == names  # wraps around after a full cycle


@pytest.mark.parametrize("names, reps", [([], 3), (["A"], 0)])
def test_rotation_refuses_nothing_to_order(names, reps):
    with pytest.raises(ValueError, match="rotation"):
        bench_e2e.rotation(names, reps)


# ---- median and spread ------------------------------------------------------------------------

def test_spread_is_median_and_range():
    s = bench_e2e.spread([3.0, 1.0, 2.0])
    assert (s.median, s.lo, s.hi, s.values) == (2.0, 1.0, 3.0, (3.0, 1.0, 2.0))
    assert bench_e2e.spread([1.0, 2.0, 4.0, 10.0]).median == 3.0
    assert s.as_json() == {"median": 2.0, "min": 1.0, "max": 3.0, "per_rep": [3.0, 1.0, 2.0]}


def test_spread_of_nothing_raises():
    with pytest.raises(ValueError, match="no values"):
        bench_e2e.spread([])


def test_ratios_pair_the_runs_of_one_repetition_and_skip_failed_ones():
    assert bench_e2e.per_rep_ratios([200.0, None, 300.0], [100.0, 100.0, 200.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="3 numerators but 2"):
        bench_e2e.per_rep_ratios([1.0, 2.0, 3.0], [1.0, 1.0])


# ---- the headline against the better sync placement --------------------------------------------

def _rep(sc: float, s: float, asy: float, trl_tok: float | None = None, asy_tok: float = 1000.0) -> dict:
    rep = {"sync_colocated": {"samples_per_s": sc, "gen_tokens_per_s": sc * 4, "gen_tokens_per_row": 4.0},
           "sync": {"samples_per_s": s, "gen_tokens_per_s": s * 4, "gen_tokens_per_row": 4.0},
           "async": {"samples_per_s": asy, "gen_tokens_per_s": asy_tok, "gen_tokens_per_row": 4.0,
                     "bound_samples_per_s": asy * 1.25, "efficiency": 0.8}}
    if trl_tok is not None:
        rep["trl_2t"] = {"samples_per_s": trl_tok / 4, "gen_tokens_per_s": trl_tok, "gen_tokens_per_row": 4.0}
    return rep


def test_better_sync_is_the_faster_placement():
    sync = bench_e2e.SYNC_MODES
    assert bench_e2e.better_of({"sync_colocated": 150.0, "sync": 250.0, "async": 400.0}, sync) == "sync"
    assert bench_e2e.better_of({"sync_colocated": 300.0, "sync": 250.0}, sync) == "sync_colocated"
    assert bench_e2e.better_of({"sync": 250.0}, sync) == "sync"
    with pytest.raises(ValueError, match="none of"):
        bench_e2e.better_of({"async": 1.0}, sync)


def test_headline_divides_by_the_better_sync_and_keeps_both():
    # disaggregated sync is the faster one: the headline must use it, not colocated
    reps = [_rep(100.0, 200.0, 300.0), _rep(110.0, 250.0, 400.0), _rep(90.0, 150.0, 300.0)]
    s = bench_e2e.summarise(reps, ROWS)
    assert s["sync_baseline"] == "sync"
    assert s["ratio_async_vs_sync"] == 1.6  # per rep 1.5, 1.6, 2.0
    assert s["ratio_range"]["ratio_async_vs_sync"] == [1.5, 2.0]
    assert s["ratio_async_vs_sync_disaggregated"] == 1.6
    assert s["ratio_async_vs_sync_colocated"] == pytest.approx(3.333, abs=1e-3)
    assert s["samples_per_s"] == {"sync_colocated": 100.0, "sync": 200.0, "async": 300.0}
    assert s["samples_per_s_range"]["async"] == [300.0, 400.0]
    assert s["target_ratio_async_vs_sync_1.6_met"] is True


def test_headline_is_a_median_of_per_rep_ratios_not_a_ratio_of_medians():
    reps = [_rep(1.0, 100.0, 300.0), _rep(1.0, 300.0, 330.0), _rep(1.0, 200.0, 100.0)]
    s = bench_e2e.summarise(reps, ROWS)
    assert s["ratio_async_vs_sync"] == 1.1  # per rep 3.0, 1.1, 0.5; medians would give 300 / 200 = 1.5
    assert s["target_ratio_async_vs_sync_1.6_met"] is False


def test_trl_ratio_is_by_generated_tokens():
    reps = [_rep(1.0, 1.0, 1.0, trl_tok=500.0, asy_tok=1000.0), _rep(1.0, 1.0, 1.0, trl_tok=400.0, asy_tok=1000.0),
            _rep(1.0, 1.0, 1.0, trl_tok=1000.0, asy_tok=1000.0)]
    s = bench_e2e.summarise(reps, ROWS)
    assert s["ratio_async_vs_trl_tokens"] == 2.0
    assert s["ratio_range"]["ratio_async_vs_trl_tokens"] == [1.0, 2.5]
    assert s["gen_tokens_per_s"]["trl_2t"] == 500.0
    assert s["trl_baseline"] == "trl_2t" and s["ratio_async_vs_trl_2t_tokens"] == 2.0
    assert s["target_ratio_async_vs_trl_tokens_1.5_met"] is True


def test_trl_headline_takes_its_better_thread_count():
    reps = [_rep(1.0, 1.0, 250.0, trl_tok=t, asy_tok=1000.0) for t in (100.0, 120.0, 80.0)]
    for rep, t in zip(reps, (600.0, 400.0, 500.0)):  # one thread, undisturbed by other load: faster here
        rep["trl_1t"] = {"samples_per_s": t / 4, "gen_tokens_per_s": t, "gen_tokens_per_row": 4.0}
    s = bench_e2e.summarise(reps, ROWS)
    assert s["trl_baseline"] == "trl_1t"
    assert s["ratio_async_vs_trl_tokens"] == 2.0  # per rep 1000/600, 1000/400, 1000/500
    assert s["ratio_async_vs_trl_2t_tokens"] == 10.0
    assert s["ratio_async_vs_trl"] == 2.0  # samples/s against the same TRL entry: 250/150, 250/100, 250/125


def test_trl_entries_one_per_thread_count():
    assert bench_e2e.trl_entries([2, 1]) == {"trl_2t": 2, "trl_1t": 1}
    assert bench_e2e.trl_entries([1, 1]) == {"trl_1t": 1}
    with pytest.raises(ValueError, match="positive"):
        bench_e2e.trl_entries([0])


def test_a_failed_run_drops_out_of_its_repetitions_ratios_only():
    reps = [_rep(100.0, 200.0, 300.0), _rep(100.0, 200.0, 500.0), _rep(100.0, 200.0, 400.0)]
    reps[1]["sync"] = {"error": "exit 1"}
    s = bench_e2e.summarise(reps, ROWS)
    assert s["ratio_range"]["ratio_async_vs_sync"] == [1.5, 2.0]
    assert s["ratio_async_vs_trl_tokens"] is None and s["target_ratio_async_vs_trl_tokens_1.5_met"] is None
    assert "ratio_async_vs_trl_tokens" not in s["ratio_range"]


# ---- the bound from stand-alone stage costs -----------------------------------------------------

def test_bound_is_set_by_the_busiest_group_of_the_standalone_costs():
    costs = {"actor_ranks": 0.2, "rollout_ranks": 0.16}
    assert bench_e2e.overlapped_bound(ROWS, costs, ["rollout_ranks", "actor_ranks"]) == pytest.approx(320.0)


def test_bound_refuses_costs_of_another_placement():
    with pytest.raises(ValueError, match="same placement"):
        bench_e2e.overlapped_bound(ROWS, {"all_ranks": 0.3}, ["actor_ranks", "rollout_ranks"])
    with pytest.raises(ValueError, match="no stage cost"):
        bench_e2e.overlapped_bound(ROWS, {"actor_ranks": 0.0, "rollout_ranks": 0.0}, ["actor_ranks", "rollout_ranks"])


def test_add_bounds_judges_async_by_the_sync_runs_costs_not_its_own():
    rep = {"sync": {"samples_per_s": 200.0, "group_s_per_step": {"actor_ranks": 0.16, "rollout_ranks": 0.128}},
           # async's own spans are inflated by overlap (shared cores): they must not set its bound
           "async": {"samples_per_s": 300.0, "group_s_per_step": {"actor_ranks": 0.3, "rollout_ranks": 0.25}}}
    bench_e2e.add_bounds(rep, ROWS)
    assert rep["async"]["bound_samples_per_s"] == pytest.approx(400.0)
    assert rep["async"]["efficiency"] == pytest.approx(0.75)
    assert "bound_samples_per_s" not in rep["sync"]


def test_add_bounds_without_a_sync_run_leaves_no_bound():
    rep = {"async": {"samples_per_s": 300.0, "group_s_per_step": {"actor_ranks": 0.3, "rollout_ranks": 0.25}}}
    bench_e2e.add_bounds(rep, ROWS)
    assert "bound_samples_per_s" not in rep["async"]


def test_union_counts_concurrent_spans_once():
    spans = [{"start": 0.0, "end": 1.0}, {"start": 0.5, "end": 1.5}, {"start": 2.0, "end": 2.5}]
    assert bench_e2e.union_s(spans) == pytest.approx(2.0)


def test_rank_groups_follow_the_placement():
    stages = ["rollout", "reward", "ref_log_prob", "update", "weight_sync"]
    g = bench_e2e.rank_groups({**DISAGG, "ref_with": "rollout"}, stages, ["rank0", "rank1"])
    assert g["rollout_ranks"].stages == {"rollout", "ref_log_prob"} and g["rollout_ranks"].ranks == {"rank1"}
    assert g["actor_ranks"].stages == {"reward", "update", "weight_sync"} and g["actor_ranks"].ranks == {"rank0"}
    g = bench_e2e.rank_groups({"mode": "colocated"}, stages, ["rank0", "rank1"])
    assert list(g) == ["all_ranks"] and g["all_ranks"].ranks == {"rank0", "rank1"}


def _run_dir(tmp: Path, ref_with: str, mode: str = "async") -> Path:
    """Two steps: rank 0 updates for 0.2 s a step, rank 1 generates for 0.1 s; the reference
    forward (0.1 s) runs on whichever rank the placement names; each row 3 or 5 tokens."""
    ref_rank = 0 if ref_with == "actor" else 1
    d = tmp / f"{mode}-{ref_with}"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"samples_per_s": 100.0, "tokens_per_s": 1000.0, "rl_s": 1.28,
                                                "rl_steps": 2, "staleness_mean": 1.0, "staleness_max": 1}))
    (d / "config.json").write_text(json.dumps({"placement": {**DISAGG, "ref_with": ref_with}}))
    steps = [{"perf/samples_per_s": 100.0, "time_s": 1.0 + i, "timing_s/update": 0.2, "timing_s/rollout": 0.1,
              "timing_s/ref_log_prob": 0.1, "reward/mean": 0.1 * i} for i in range(2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    spans = []
    for i in range(2):
        t = float(i)
        spans += [{"lane": "rank1 rollout0", "stage": "rollout", "start": t, "end": t + 0.1},
                  {"lane": f"rank{ref_rank} ref", "stage": "ref_log_prob", "start": t + 0.1, "end": t + 0.2},
                  {"lane": "rank0 actor", "stage": "update", "start": t + 0.3, "end": t + 0.5},
                  # the rollout side's receive is not charged; the actor side's publish is
                  {"lane": "rank1 rollout0", "stage": "weight_sync", "start": t + 0.5, "end": t + 0.9}]
    (d / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    rows = [{"response_ids": [1] * (3 if k % 2 else 5)} for k in range(2 * ROWS)]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"prompts": 16, "group": 4, "max_new_tokens": 16, "lengths": "natural", **kw})


@pytest.mark.parametrize("ref_with, actor_s, rollout_s", [("actor", 0.3, 0.1), ("rollout", 0.2, 0.2)])
def test_reference_cost_goes_to_the_ranks_it_ran_on(tmp_path, ref_with, actor_s, rollout_s):
    r = bench_e2e.analyse(_run_dir(tmp_path, ref_with), _args())
    assert r["group_s_per_step"] == pytest.approx({"actor_ranks": actor_s, "rollout_ranks": rollout_s})


def test_disaggregated_modes_share_one_placement():
    a = argparse.Namespace(ref_with="rollout")
    for name in ("sync", "stream", "async"):
        assert bench_e2e.placement_overrides(bench_e2e.MODES[name], a) == ["placement.ref_with=rollout"]
    assert bench_e2e.placement_overrides(bench_e2e.MODES["sync_colocated"], a) == []


# ---- token counting ---------------------------------------------------------------------------

def test_generated_tokens_count_every_response_token_and_no_prompt():
    # AsyncFlow's response_ids and TRL's kept completion_ids: the EOS a row ended with is one of its tokens
    eos = 0
    assert bench_e2e.generated_tokens([[4, 6, eos], [1, 2, 3, 4], []]) == 7


def test_analyse_counts_generated_tokens_over_the_rl_clock(tmp_path):
    r = bench_e2e.analyse(_run_dir(tmp_path, "rollout"), _args())
    assert r["gen_tokens"] == ROWS * 5 + ROWS * 3
    assert r["gen_tokens_per_row"] == 4.0
    assert r["gen_tokens_per_s"] == pytest.approx(r["gen_tokens"] / 1.28)
    assert r["tokens_per_s_with_prompts"] == 1000.0  # the summary's figure counts prompts: kept apart


def test_fixed_lengths_are_checked_row_by_row(tmp_path):
    bench_e2e.check_fixed_lengths([16, 16, 16], 16, "run")
    with pytest.raises(ValueError, match="2 of 3 rows .* fixed 16 tokens"):
        bench_e2e.check_fixed_lengths([16, 4, 9], 16, "run")
    with pytest.raises(ValueError, match="EOS was not ignored"):
        bench_e2e.analyse(_run_dir(tmp_path, "rollout"), _args(lengths="fixed", max_new_tokens=5))


def test_length_stats():
    s = bench_e2e.length_stats([1, 2, 3, 16], 16)
    assert s == {"mean": 5.5, "p50": 3, "p90": 16, "max": 16, "at_cap": 0.25}
    assert bench_e2e.length_stats([], 16)["mean"] == 0.0


# ---- what the runs are told -------------------------------------------------------------------

def test_every_run_starts_from_the_warm_up_and_lengths_reach_asyncflow(tmp_path):
    a = _args(steps=16, batch_prompts=16, seed=0, threads=1, num_eval=256)
    assert bench_e2e.start_from(tmp_path) == [f"model.path={tmp_path}", "model.attn_implementation=eager",
                                              "warmup.enabled=false"]
    natural = bench_e2e.workload_overrides(a)
    assert "rollout.max_new_tokens=16" in natural and not any("ignore_eos" in o for o in natural)
    assert not any("length_profile" in o for o in natural)  # no per-row budget: EOS or the cap, as TRL
    assert "rollout.ignore_eos=true" in bench_e2e.workload_overrides(_args(**{**vars(a), "lengths": "fixed"}))
    assert "trainer.steps=0" in bench_e2e.warmup_overrides(a)


def test_a_hung_run_is_killed_with_the_processes_it_started(tmp_path):
    marker = tmp_path / "child_lived"
    # the child of the command outlives it unless the whole process group is killed
    cmd = ["bash", "-c", f"(sleep 1.5; touch {marker}) & sleep 30"]
    with open(tmp_path / "log", "w") as log:
        assert bench_e2e.run_group(cmd, log, 0.3) == "timeout"
    import time
    time.sleep(2.0)
    assert not marker.exists()


# ---- memory from /proc --------------------------------------------------------------------------

def test_status_and_stat_are_read_as_the_kernel_writes_them():
    status = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t4\n"
    assert bench_e2e.status_kb(status) == 102400 and bench_e2e.status_kb(status, "VmHWM") == 204800
    assert bench_e2e.status_kb("Name:\tkthreadd\n") is None
    # the command name may hold spaces and parentheses: the parent pid is read after the last ')'
    assert bench_e2e.stat_ppid("4242 (VLLM::Worker (x) y) S 4100 4242 4100 0 -1") == 4100


def test_descendants_walk_the_whole_tree_and_nothing_beside_it():
    parent_of = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert bench_e2e.descendants(parent_of, 10) == [11, 12, 13]
    assert bench_e2e.descendants(parent_of, 12) == []


def test_tree_rss_sees_a_child_process(tmp_path):
    import subprocess
    import time
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the child holds its 64 MB
            if bench_e2e.rss_kb([child.pid]).get(child.pid, 0) > 60 << 10:
                break
            time.sleep(0.1)
        sampler = bench_e2e.TreeRSS(os.getpid(), interval_s=0.05)
        sampler.sample()
        out = sampler.stop()
        assert child.pid in bench_e2e.descendants(bench_e2e.process_table(), os.getpid())
        assert out["processes_at_peak"] >= 2 and out["peak_tree_rss_mb"] > 64
    finally:
        child.kill()
        child.wait()


# ---- vLLM entries -------------------------------------------------------------------------------

def test_the_main_job_on_vllm_is_async_with_its_rollout_on_vllm():
    from asyncflow.config import load_config
    assert bench_e2e.MODES["async_vllm"][:3] == bench_e2e.MODES["async"]
    cfg = load_config(bench_e2e.RECIPE, bench_e2e.MODES["async_vllm"])  # parses without vLLM installed
    assert cfg.rollout.engine == "vllm" and cfg.workflow.mode == "async"
    assert cfg.rollout.engine_kwargs == {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
    a = argparse.Namespace(ref_with="rollout")  # the placement of the other disaggregated modes
    assert bench_e2e.placement_overrides(bench_e2e.MODES["async_vllm"], a) == ["placement.ref_with=rollout"]


def test_vllm_modes_join_only_with_the_flag():
    builtin = ["sync_colocated", "sync", "stream", "async"]
    assert bench_e2e.select_modes(",".join(bench_e2e.BUILTIN_MODES), False) == builtin
    assert bench_e2e.select_modes("", True) == [*builtin, "async_vllm"]
    assert bench_e2e.select_modes("async", True) == ["async", "async_vllm"]
    assert bench_e2e.select_modes("async,async_vllm", True) == ["async", "async_vllm"]
    with pytest.raises(ValueError, match="unknown"):
        bench_e2e.select_modes("async,vllm", False)


def test_trl_vllm_entries_and_their_longer_time_limit():
    assert bench_e2e.trl_entries([1], vllm=True) == {"trl_vllm_1t": 1}
    with pytest.raises(ValueError, match="--trl-vllm-threads"):
        bench_e2e.trl_entries([0], vllm=True)
    assert bench_e2e.entry_timeout("async", 150.0) == 150.0
    assert bench_e2e.entry_timeout("trl_2t", 150.0) == 150.0
    for name in ("async_vllm", "trl_vllm_1t"):
        assert bench_e2e.entry_timeout(name, 150.0) == 150.0 + bench_e2e.VLLM_EXTRA_TIMEOUT_S


def test_trl_vllm_venv_keeps_vllms_pins():
    req = "# comment\nnumpy==2.3.5\n\n# Editable Git install\ntransformers==5.19.0\n-e git+x#egg=asyncflow\n"
    assert bench_e2e.vllm_constraints(req).splitlines() == ["numpy==2.3.5", "transformers==5.19.0",
                                                            f"torch=={bench_e2e.TORCH}"]


def test_the_best_trl_entry_may_be_the_vllm_one_and_async_vllm_is_judged_against_it():
    reps = [_rep(1.0, 1.0, 250.0, trl_tok=t, asy_tok=1000.0) for t in (400.0, 500.0, 600.0)]
    for k, rep in enumerate(reps):
        rep["trl_vllm_1t"] = {"samples_per_s": 200.0, "gen_tokens_per_s": 800.0, "gen_tokens_per_row": 4.0,
                              "peak_tree_rss_mb": 3000.0 + k}
        rep["async_vllm"] = {"samples_per_s": 125.0 * (k + 1), "gen_tokens_per_s": 400.0 * (k + 1),
                             "gen_tokens_per_row": 4.0, "peak_tree_rss_mb": 4000.0 + k}
        rep["async"]["peak_tree_rss_mb"] = 1500.0
    s = bench_e2e.summarise(reps, ROWS)
    assert s["trl_baseline"] == "trl_vllm_1t"
    assert s["ratio_async_vs_trl_tokens"] == 1.25  # 1000 / 800 in every repetition
    assert s["ratio_async_vs_trl_2t_tokens"] == 2.0  # 1000/400, 1000/500, 1000/600
    assert s["ratio_async_vllm_vs_async"] == 1.0  # 125/250, 250/250, 375/250
    assert s["ratio_range"]["ratio_async_vllm_vs_async"] == [0.5, 1.5]
    assert s["ratio_async_vllm_vs_trl_tokens"] == 1.0  # 400/800, 800/800, 1200/800
    assert s["peak_tree_rss_mb"] == {"async": 1500.0, "trl_vllm_1t": 3001.0, "async_vllm": 4001.0}


def test_rotation_is_balanced_only_over_a_multiple_of_the_entries():
    names = ["async", "async_vllm", "trl_1t", "trl_vllm_1t"]
    assert bench_e2e.positions_balanced(bench_e2e.rotation(names, 4))
    assert bench_e2e.positions_balanced(bench_e2e.rotation(names, 8))
    assert not bench_e2e.positions_balanced(bench_e2e.rotation(names, 3))
