"""perf/bench_e2e.py's pure logic: the balanced order of the repetitions, the configurations
swept and chosen, medians and spreads, the better-of-sync headline, the bound from stand-alone
stage costs, the long-tailed targets, and how generated and useful tokens are counted."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_e2e

ROWS = 64
DISAGG = {"mode": "disaggregated", "actor_ranks": [0], "rollout_ranks": [1], "reward_with": "actor"}


# ---- the order of the repetitions ----------------------------------------------------------------

def test_rotation_is_cyclic_as_perf_convergence_uses_it():
    assert bench_e2e.rotation(["A", "B", "C", "D"], 3) == [["A", "B", "C", "D"], ["B", "C", "D", "A"],
                                                           ["C", "D", "A", "B"]]
    orders = bench_e2e.rotation(["A", "B", "C"], 3)
    assert bench_e2e.positions_balanced(orders)
    assert not bench_e2e.carryover_balanced(orders)  # B always follows A: why the bench does not use it


@pytest.mark.parametrize("names, reps", [([], 3), (["A"], 0)])
def test_rotation_refuses_nothing_to_order(names, reps):
    with pytest.raises(ValueError, match="rotation"):
        bench_e2e.rotation(names, reps)


def test_williams_design_first_rows():
    assert bench_e2e.williams_design(4) == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert bench_e2e.williams_design(3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    assert bench_e2e.williams_design(1) == [[0]]
    with pytest.raises(ValueError):
        bench_e2e.williams_design(0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_a_whole_williams_design_balances_positions_and_neighbours(n):
    names = [f"e{i}" for i in range(n)]
    rows = 2 * n if n % 2 else n
    orders = bench_e2e.balanced_orders(names, rows)
    for order in orders:
        assert sorted(order) == sorted(names)
    for pos in range(n):  # each entry in each position equally often
        counts = {m: sum(o[pos] == m for o in orders) for m in names}
        assert set(counts.values()) == {rows // n}
    follows = {(a, b): 0 for a in names for b in names if a != b}
    for o in orders:
        for a, b in zip(o, o[1:]):
            follows[(a, b)] += 1
    assert len(set(follows.values())) <= 1  # each entry right after each other equally often
    assert bench_e2e.positions_balanced(orders) and bench_e2e.carryover_balanced(orders)


def test_six_entries_every_neighbour_once_in_six_repetitions():
    names = ["sync_colocated", "sync", "stream", "async", "trl", "trl_vllm"]
    orders = bench_e2e.balanced_orders(names, 6)
    pairs = [(a, b) for o in orders for a, b in zip(o, o[1:])]
    assert len(pairs) == len(set(pairs)) == 6 * 5  # every ordered pair exactly once
    assert [o[0] for o in orders] == names  # and every entry starts once
    assert bench_e2e.positions_balanced(orders)
    # the old cyclic rotation: async always right after stream
    assert all(o[(o.index("stream") + 1) % 6] == "async" for o in bench_e2e.rotation(names, 6))


def test_odd_entries_positions_over_n_repetitions_neighbours_over_2n():
    names = ["sync_colocated", "sync", "stream", "async", "trl"]
    half = bench_e2e.balanced_orders(names, 5)
    assert bench_e2e.positions_balanced(half) and not bench_e2e.carryover_balanced(half)
    assert bench_e2e.carryover_balanced(bench_e2e.balanced_orders(names, 10))


def test_repetitions_are_raised_to_a_balanced_count_and_others_refused():
    assert bench_e2e.balanced_reps(0, 5) == 5
    assert bench_e2e.balanced_reps(3, 5) == 5  # fewer repetitions than entries: raised
    assert bench_e2e.balanced_reps(7, 5) == 10
    assert bench_e2e.balanced_reps(0, 2) == 4  # at least 3 for a median and a spread
    assert bench_e2e.balanced_reps(6, 6) == 6
    with pytest.raises(ValueError, match="multiple of 5"):
        bench_e2e.balanced_orders(["a", "b", "c", "d", "e"], 3)
    with pytest.raises(ValueError, match="distinct"):
        bench_e2e.balanced_orders(["a", "a"], 2)


def test_positions_balanced_detects_an_entry_stuck_in_front():
    assert not bench_e2e.positions_balanced([["a", "b"], ["a", "b"]])
    assert bench_e2e.positions_balanced([["a", "b"], ["b", "a"]])


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
           "async": {"samples_per_s": asy, "gen_tokens_per_s": asy_tok, "useful_tokens_per_s": asy_tok,
                     "gen_tokens_per_row": 4.0,
                     "bound_samples_per_s": asy * 1.25, "efficiency": 0.8}}
    if trl_tok is not None:
        rep["trl"] = _trl(trl_tok)
    return rep


def _trl(tok: float, wasted: float = 0.0) -> dict:
    """A TRL run of ``tok`` useful tokens/s, and ``wasted`` more generated and cut off."""
    return {"samples_per_s": tok / 4, "gen_tokens_per_s": tok + wasted, "useful_tokens_per_s": tok,
            "gen_tokens_per_row": 4.0 * (tok + wasted) / tok, "useful_tokens_per_row": 4.0}


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
    assert s["useful_tokens_per_s"]["trl"] == 500.0
    assert s["trl_baseline"] == "trl"
    assert s["target_ratio_async_vs_trl_tokens_1.5_met"] is True


def test_trl_is_judged_by_useful_tokens_not_the_padding_it_generated():
    # TRL generated twice the tokens it kept (rows cut to their targets): only the kept ones count
    reps = [_rep(1.0, 1.0, 1.0, asy_tok=1000.0) for _ in range(3)]
    for rep in reps:
        rep["trl"] = _trl(500.0, wasted=500.0)
    s = bench_e2e.summarise(reps, ROWS)
    assert s["ratio_async_vs_trl_tokens"] == 2.0
    assert s["gen_tokens_per_s"]["trl"] == 1000.0 and s["useful_tokens_per_s"]["trl"] == 500.0
    assert s["gen_tokens_per_row"]["trl"] == 8.0 and s["useful_tokens_per_row"]["trl"] == 4.0


def test_trl_headline_takes_the_better_trl_entry():
    reps = [_rep(1.0, 1.0, 250.0, trl_tok=t, asy_tok=1000.0) for t in (100.0, 120.0, 80.0)]
    for rep, t in zip(reps, (600.0, 400.0, 500.0)):
        rep["trl_vllm"] = _trl(t)
    s = bench_e2e.summarise(reps, ROWS)
    assert s["trl_baseline"] == "trl_vllm"
    assert s["ratio_async_vs_trl_tokens"] == 2.0  # per rep 1000/600, 1000/400, 1000/500
    assert s["ratio_async_vs_entry_trl_tokens"] == 10.0  # the other TRL entry, under its own name
    assert s["ratio_async_vs_trl"] == 2.0  # samples/s against the same TRL entry: 250/150, 250/100, 250/125


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


def test_add_bounds_judges_async_by_the_standalone_costs_not_its_own_nor_the_reps_sync():
    rep = {"sync": {"samples_per_s": 200.0, "group_s_per_step": {"actor_ranks": 0.5, "rollout_ranks": 0.5}},
           # async's own spans are inflated by overlap (shared cores): they must not set its bound
           "async": {"samples_per_s": 300.0, "group_s_per_step": {"actor_ranks": 0.3, "rollout_ranks": 0.25}}}
    standalone = {"async": {"actor_ranks": 0.16, "rollout_ranks": 0.128}}  # a run outside the repetitions
    bench_e2e.add_bounds(rep, ROWS, standalone)
    assert rep["async"]["bound_samples_per_s"] == pytest.approx(400.0)
    assert rep["async"]["efficiency"] == pytest.approx(0.75)
    assert rep["async"]["standalone_group_s_per_step"] == standalone["async"]
    assert "bound_samples_per_s" not in rep["sync"]


def test_add_bounds_without_standalone_costs_leaves_no_bound():
    rep = {"async": {"samples_per_s": 300.0, "group_s_per_step": {"actor_ranks": 0.3, "rollout_ranks": 0.25}}}
    bench_e2e.add_bounds(rep, ROWS, {})
    assert "bound_samples_per_s" not in rep["async"]


def test_standalone_costs_are_the_median_over_runs_failed_ones_left_out():
    runs = [{"group_s_per_step": {"a": 1.0, "b": 4.0}}, {"error": "exit 1"},
            {"group_s_per_step": {"a": 3.0, "b": 2.0}}, {"group_s_per_step": {"a": 2.0, "b": 3.0}}]
    assert bench_e2e.median_costs(runs) == {"a": 2.0, "b": 3.0}
    assert bench_e2e.median_costs([{"error": "x"}]) is None


def test_the_standalone_run_has_the_judged_modes_placement_and_threads():
    # async at auto resolves to one thread per rank on 2 cores: its bound comes from sync at 1 thread
    s = bench_e2e.standalone_setting("async", bench_e2e.Setting(0, "inline"), cpus=2)
    assert s == bench_e2e.Setting(1, "inline")
    assert bench_e2e.same_setting("sync", bench_e2e.Setting(1, "inline"), "async", bench_e2e.Setting(0, "inline"), 2)
    # sync at auto: every core, not async's one thread
    assert not bench_e2e.same_setting("sync", bench_e2e.Setting(0, "inline"), "async",
                                      bench_e2e.Setting(0, "inline"), 2)
    assert not bench_e2e.same_setting("sync", bench_e2e.Setting(1, "actor"), "async",
                                      bench_e2e.Setting(1, "rollout"), 2)


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
    return argparse.Namespace(**{"prompts": 16, "group": 4, "max_new_tokens": 16, "lengths": "natural",
                                 "lr": bench_e2e.DEFAULT_LR, **kw})


@pytest.mark.parametrize("ref_with, actor_s, rollout_s", [("actor", 0.3, 0.1), ("rollout", 0.2, 0.2)])
def test_reference_cost_goes_to_the_ranks_it_ran_on(tmp_path, ref_with, actor_s, rollout_s):
    r = bench_e2e.analyse(_run_dir(tmp_path, ref_with), _args())
    assert r["group_s_per_step"] == pytest.approx({"actor_ranks": actor_s, "rollout_ranks": rollout_s})


def test_a_setting_gives_threads_and_reward_placement_and_disaggregated_modes_share_the_reference():
    a = argparse.Namespace(ref_with="rollout")
    s = bench_e2e.Setting(0, "inline")
    for name in ("sync", "stream", "async"):
        assert bench_e2e.setting_overrides(name, s, a) == ["trainer.threads=0", "placement.reward_with=inline",
                                                           "placement.ref_with=rollout"]
    assert bench_e2e.setting_overrides("sync_colocated", bench_e2e.Setting(2, "actor"), a) == [
        "trainer.threads=2", "placement.reward_with=actor"]


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
    a = _args(steps=16, batch_prompts=16, seed=0, num_eval=256)
    assert bench_e2e.start_from(tmp_path) == [f"model.path={tmp_path}", "model.attn_implementation=eager",
                                              "warmup.enabled=false"]
    natural = bench_e2e.workload_overrides(a)
    assert "rollout.max_new_tokens=16" in natural and not any("ignore_eos" in o for o in natural)
    assert not any("length_profile" in o for o in natural)  # no per-row budget: EOS or the cap, as TRL
    assert not any("threads" in o or "reward_with" in o for o in natural)  # each mode's setting says those
    fixed = bench_e2e.workload_overrides(_args(**{**vars(a), "lengths": "fixed"}))
    assert "rollout.ignore_eos=true" in fixed and not any("length_profile" in o for o in fixed)
    longtail = bench_e2e.workload_overrides(_args(**{**vars(a), "lengths": "longtail", "max_new_tokens": 112}))
    assert {"rollout.ignore_eos=true", "rollout.length_profile=longtail", "rollout.max_new_tokens=112"} <= set(longtail)
    assert "trainer.steps=0" in bench_e2e.warmup_overrides(a)


def test_the_learning_rate_is_the_workload_s_on_both_sides():
    """Every AsyncFlow run gets --lr, and the config that TRL's spec reads its rate from has it."""
    from asyncflow.config import load_config

    assert bench_e2e.parse_args([]).lr == bench_e2e.DEFAULT_LR
    a = _args(steps=16, batch_prompts=16, seed=0, num_eval=256, lr=2e-5)
    overrides = bench_e2e.workload_overrides(a)
    assert "optim.lr=2e-05" in overrides
    assert load_config(bench_e2e.RECIPE, overrides).optim.lr == 2e-5  # trl_spec's "lr"


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
    assert bench_e2e.setting_overrides("async_vllm", bench_e2e.Setting(0, "rollout"), a)[-1] == \
        "placement.ref_with=rollout"


def test_vllm_modes_join_only_with_the_flag():
    builtin = ["sync_colocated", "sync", "stream", "async"]
    assert bench_e2e.select_modes(",".join(bench_e2e.BUILTIN_MODES), False) == builtin
    assert bench_e2e.select_modes("", True) == [*builtin, "async_vllm"]
    assert bench_e2e.select_modes("async", True) == ["async", "async_vllm"]
    assert bench_e2e.select_modes("async,async_vllm", True) == ["async", "async_vllm"]
    with pytest.raises(ValueError, match="unknown"):
        bench_e2e.select_modes("async,vllm", False)


def test_trl_settings_and_the_vllm_entries_longer_time_limit():
    assert [s.label for s in bench_e2e.trl_settings([2, 1, 2])] == ["2t", "1t"]
    with pytest.raises(ValueError, match="--trl-vllm-threads"):
        bench_e2e.trl_settings([0], vllm=True)
    with pytest.raises(ValueError, match="--trl-threads"):
        bench_e2e.trl_settings([])
    assert bench_e2e.entry_timeout("async", 150.0) == 150.0
    assert bench_e2e.entry_timeout("trl", 150.0) == 150.0
    for name in ("async_vllm", "trl_vllm"):
        assert bench_e2e.entry_timeout(name, 150.0) == 150.0 + bench_e2e.VLLM_EXTRA_TIMEOUT_S


def test_trl_vllm_venv_keeps_vllms_pins():
    req = "# comment\nnumpy==2.3.5\n\n# Editable Git install\ntransformers==5.19.0\n-e git+x#egg=asyncflow\n"
    assert bench_e2e.vllm_constraints(req).splitlines() == ["numpy==2.3.5", "transformers==5.19.0",
                                                            f"torch=={bench_e2e.TORCH}"]


def test_the_best_trl_entry_may_be_the_vllm_one_and_async_vllm_is_judged_against_it():
    reps = [_rep(1.0, 1.0, 250.0, trl_tok=t, asy_tok=1000.0) for t in (400.0, 500.0, 600.0)]
    for k, rep in enumerate(reps):
        rep["trl_vllm"] = {**_trl(800.0), "samples_per_s": 200.0, "peak_tree_rss_mb": 3000.0 + k}
        rep["async_vllm"] = {"samples_per_s": 125.0 * (k + 1), "gen_tokens_per_s": 400.0 * (k + 1),
                             "useful_tokens_per_s": 400.0 * (k + 1), "gen_tokens_per_row": 4.0,
                             "peak_tree_rss_mb": 4000.0 + k}
        rep["async"]["peak_tree_rss_mb"] = 1500.0
    s = bench_e2e.summarise(reps, ROWS)
    assert s["trl_baseline"] == "trl_vllm"
    assert s["ratio_async_vs_trl_tokens"] == 1.25  # 1000 / 800 in every repetition
    assert s["ratio_async_vs_entry_trl_tokens"] == 2.0  # 1000/400, 1000/500, 1000/600
    assert s["ratio_async_vllm_vs_async"] == 1.0  # 125/250, 250/250, 375/250
    assert s["ratio_range"]["ratio_async_vllm_vs_async"] == [0.5, 1.5]
    assert s["ratio_async_vllm_vs_trl_tokens"] == 1.0  # 400/800, 800/800, 1200/800
    assert s["peak_tree_rss_mb"] == {"async": 1500.0, "trl_vllm": 3001.0, "async_vllm": 4001.0}


def test_rotation_is_balanced_only_over_a_multiple_of_the_entries():
    names = ["async", "async_vllm", "trl", "trl_vllm"]
    assert bench_e2e.positions_balanced(bench_e2e.rotation(names, 4))
    assert bench_e2e.positions_balanced(bench_e2e.rotation(names, 8))
    assert not bench_e2e.positions_balanced(bench_e2e.rotation(names, 3))


# ---- each entry at its own best: the configurations swept and chosen ----------------------------

def test_reward_placements_are_the_configs_values():
    from asyncflow.config import ConfigError, load_config
    for r in bench_e2e.REWARD_PLACEMENTS:
        assert load_config(bench_e2e.RECIPE, [f"placement.reward_with={r}"]).placement.reward_with == r
    with pytest.raises(ConfigError):
        load_config(bench_e2e.RECIPE, ["placement.reward_with=elsewhere"])


def test_threads_resolve_by_the_products_rule():
    # auto: every core in sync disaggregated (torch's default), the cores shared out otherwise
    assert bench_e2e.resolved_threads("sync", 0, 2) == 2
    assert bench_e2e.resolved_threads("async", 0, 2) == 1
    assert bench_e2e.resolved_threads("sync_colocated", 0, 2) == 1
    assert bench_e2e.resolved_threads("stream", 0, 16) == 8
    assert bench_e2e.resolved_threads("async", 3, 2) == 3


def test_mode_settings_run_each_resolved_thread_count_and_placement_once():
    rewards = ["actor", "rollout", "inline"]
    sync = bench_e2e.mode_settings("sync", [0, 1, 2], rewards, cpus=2)
    # auto is 2 threads in sync: the explicit 2 is the same run and goes
    assert [s.label for s in sync] == ["auto_reward_actor", "auto_reward_rollout", "auto_reward_inline",
                                       "1t_reward_actor", "1t_reward_rollout", "1t_reward_inline"]
    asy = bench_e2e.mode_settings("async", [2, 1, 0], rewards, cpus=2)  # auto first whatever the order asked
    assert [s.label for s in asy][:3] == ["auto_reward_actor", "auto_reward_rollout", "auto_reward_inline"]
    assert {s.threads for s in asy} == {0, 2}
    # colocated: actor and rollout are the same ranks
    col = bench_e2e.mode_settings("sync_colocated", [0, 2], rewards, cpus=2)
    assert [s.label for s in col] == ["auto_reward_actor", "auto_reward_inline", "2t_reward_actor",
                                      "2t_reward_inline"]
    with pytest.raises(ValueError, match="--reward-with"):
        bench_e2e.mode_settings("sync", [0], ["actor", "beside"], cpus=2)
    with pytest.raises(ValueError, match="--threads"):
        bench_e2e.mode_settings("sync", [-1], ["actor"], cpus=2)


def test_sweep_order_interleaves_entries_and_reverses_each_pass():
    S = bench_e2e.Setting
    settings = {"sync": [S(0, "actor"), S(1, "actor"), S(0, "inline")], "trl": [S(2), S(1)]}
    one = [("sync", S(0, "actor")), ("trl", S(2)), ("sync", S(1, "actor")), ("trl", S(1)), ("sync", S(0, "inline"))]
    assert bench_e2e.sweep_order(settings, 1) == one
    assert bench_e2e.sweep_order(settings, 2) == one + one[::-1]


def test_choose_takes_the_best_median_and_skips_failed_runs():
    results = {"auto": [{"samples_per_s": 100.0}, {"samples_per_s": 300.0}, {"samples_per_s": 110.0}],
               "1t": [{"samples_per_s": 200.0}, {"error": "exit 1"}],
               "2t": [{"error": "timeout"}]}
    assert bench_e2e.choose(results, "samples_per_s") == "1t"  # medians 110 and 200; one lucky 300 does not win
    with pytest.raises(ValueError, match="every configuration failed"):
        bench_e2e.choose({"2t": [{"error": "timeout"}]}, "samples_per_s")


def test_the_cli_refuses_what_it_cannot_measure_fairly(capsys):
    a = bench_e2e.parse_args(["--quick", "--lengths", "longtail", "--no-trl"])
    assert (a.steps, a.sweep_steps, a.max_new_tokens, a.reps) == (16, 16, 112, 0)
    assert a.threads_list == [0, 1, 2] and a.reward_list == list(bench_e2e.REWARD_PLACEMENTS)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--reward-with", "actor,nowhere"])
    assert "--reward-with" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # TRL's vLLM entry cannot honour per-row targets
        bench_e2e.parse_args(["--lengths", "longtail", "--vllm", "--modes", "async"])
    assert "--trl-vllm-threads" in capsys.readouterr().err


# ---- the long-tailed workload -----------------------------------------------------------------

def test_row_targets_are_asyncflows_budgets_long_tailed_and_capped():
    from asyncflow.workflow.source import longtail_budgets
    t = bench_e2e.row_targets(0, 112, 256, 4)
    fn = longtail_budgets(0, 112)
    assert t[5] == [fn(5, j) for j in range(4)]
    flat = sorted(x for row in t for x in row)
    assert flat[0] >= 1 and flat[-1] == 112
    median = flat[len(flat) // 2]
    assert 10 <= median <= 25 and 112 / median >= 4  # most rows short, a tail to the cap


def _longtail_rows(targets, seed, cut=None):
    from asyncflow.workflow.source import row_seed
    rows = [{"uid": u, "seed": row_seed(seed, u, j), "response_ids": [7] * t}
            for u, ts in enumerate(targets) for j, t in enumerate(ts)]
    return rows[::-1]  # any order


def test_check_targets_accepts_each_row_at_its_target_in_any_order():
    targets = bench_e2e.row_targets(3, 32, 6, 4)
    bench_e2e.check_targets(_longtail_rows(targets, 3), targets, 3, "run")


def test_check_targets_refuses_a_row_stopped_early_or_other_prompts():
    targets = bench_e2e.row_targets(3, 32, 6, 4)
    rows = _longtail_rows(targets, 3)
    rows[2] = {**rows[2], "response_ids": rows[2]["response_ids"][:-1] or [1, 1]}
    with pytest.raises(ValueError, match="do not have their target length"):
        bench_e2e.check_targets(rows, targets, 3, "run")
    with pytest.raises(ValueError, match="not the 24 rows"):
        bench_e2e.check_targets(_longtail_rows(targets, 3)[:-1], targets, 3, "run")  # one row missing
    with pytest.raises(ValueError, match="not the 24 rows"):
        bench_e2e.check_targets(_longtail_rows(targets, 4), targets, 3, "run")  # other seeds: other samples


def test_analyse_longtail_counts_every_generated_token_as_useful(tmp_path):
    from asyncflow.workflow.source import row_seed
    d = _run_dir(tmp_path, "rollout")
    targets = bench_e2e.row_targets(0, 32, 2 * 16, 4)  # 2 steps x 16 prompts
    rows = [{"step": u // 16, "uid": u, "seed": row_seed(0, u, j), "response_ids": [5] * t}
            for u, ts in enumerate(targets) for j, t in enumerate(ts)]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = bench_e2e.analyse(d, _args(lengths="longtail", max_new_tokens=32, steps=2, seed=0))
    total = sum(map(sum, targets))
    assert r["gen_tokens"] == r["useful_tokens"] == total
    assert r["useful_tokens_per_row"] == pytest.approx(total / 128)


# ---- the TRL peer's per-row targets -------------------------------------------------------------

def test_trl_rows_take_their_prompts_targets_in_turn():
    import _trl_peer
    targets = [[3, 9], [5, 1]]
    assert _trl_peer.batch_targets([0, 0, 1, 1], targets) == [3, 9, 5, 1]
    assert _trl_peer.batch_targets([1, 0, 1, 0], targets) == [5, 3, 1, 9]


def test_trl_rows_are_cut_to_their_targets_after_a_batch_run_to_the_longest():
    import _trl_peer
    rows = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert _trl_peer.cut_to_targets(rows, [2, 4], 4) == [[1, 2], [5, 6, 7, 8]]
    with pytest.raises(RuntimeError, match="all should have 4"):
        _trl_peer.cut_to_targets([[1, 2, 3, 4], [5, 6]], [2, 4], 4)  # a row stopped early: EOS not suppressed
    with pytest.raises(RuntimeError, match="2 completions for 3 targets"):
        _trl_peer.cut_to_targets(rows, [1, 2, 3], 4)


# ---- the whole bench with fake runs: sweep, choice, stand-alone bounds, balanced repetitions ------

def test_the_sweep_chooses_and_the_repetitions_judge_with_other_runs(tmp_path, monkeypatch):
    calls = []
    speed = {("sync", "auto_reward_actor"): 300.0, ("sync", "auto_reward_rollout"): 250.0,
             ("async", "auto_reward_actor"): 350.0, ("async", "auto_reward_rollout"): 450.0, ("trl", "2t"): 200.0,
             ("trl", "1t"): 400.0}

    def fake_run(entry, setting, a, parent, model, spec, name=None):
        calls.append((parent.name, entry, setting.label))
        sps = speed.get((entry, setting.label), 100.0)
        return {"samples_per_s": sps, "gen_tokens_per_s": 4 * sps, "useful_tokens_per_s": 4 * sps,
                "gen_tokens_per_row": 4.0, "useful_tokens_per_row": 4.0,
                "group_s_per_step": {"actor_ranks": 0.2, "rollout_ranks": 0.1}}

    monkeypatch.setattr(bench_e2e, "run_entry", fake_run)
    monkeypatch.setattr(bench_e2e, "warm_up", lambda a, out: {"model": str(tmp_path), "warmup_steps": 1,
                                                              "accuracy": 0.2, "reused": True})
    monkeypatch.setattr(bench_e2e, "ensure_trl_venv", lambda log: None)
    monkeypatch.setattr(bench_e2e, "trl_spec", lambda a, model: {"steps": a.steps})
    monkeypatch.setattr(bench_e2e, "plot", lambda *args, **kw: None)
    monkeypatch.setattr(bench_e2e, "code_version", lambda: None)
    import asyncflow.config
    monkeypatch.setattr(asyncflow.config, "usable_cpus", lambda: 2)
    bench_e2e.main(["--modes", "sync,async", "--threads", "0", "--reward-with", "actor,rollout",
                    "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    s = res["summary"]
    assert {e: c["label"] for e, c in s["settings"].items()} == {
        "sync": "auto_reward_actor", "async": "auto_reward_rollout", "trl": "1t"}
    assert s["sweep"]["sync"]["configs"]["auto_reward_rollout"]["samples_per_s"] == [250.0, 250.0]  # two passes
    assert s["sweep"]["trl"]["chosen"] == "1t"
    for p in ("pass0", "pass1"):  # by default every configuration runs twice, once in each pass
        sweep = [c for c in calls if c[0] == p]
        assert len(sweep) == 6 and len(set(sweep)) == 6
    # async runs at 1 thread per rank with its reward beside the rollout: the sweep's sync ran at 2
    # threads, so its bound comes from a stand-alone sync run of that configuration
    assert [c for c in calls if c[0] == "standalone"] == [("standalone", "sync", "1t_reward_rollout")]
    assert s["standalone_for_bounds"]["async"]["source"] == "own run: sync 1t_reward_rollout"
    reps = [c for c in calls if c[0].startswith("rep")]
    assert s["reps"] == 3 and len(reps) == 9  # 3 entries: 3 repetitions, each entry in each slot once
    assert {(e, label) for _, e, label in reps} == {("sync", "auto_reward_actor"), ("async", "auto_reward_rollout"),
                                                    ("trl", "1t")}
    assert s["orders_balanced"] is True and s["carryover_balanced"] is False  # 3 entries: 6 for neighbours
    assert s["sync_baseline"] == "sync" and s["ratio_async_vs_sync"] == 1.5
    assert s["trl_baseline"] == "trl" and s["ratio_async_vs_trl_tokens"] == 1.125
    assert s["efficiency_vs_bound"]["async"] == pytest.approx(450.0 / (ROWS / 0.2), abs=1e-3)


def test_no_sweep_runs_the_first_configuration_and_still_bounds_from_apart(tmp_path, monkeypatch):
    calls = []

    def fake_run(entry, setting, a, parent, model, spec, name=None):
        calls.append((parent.name, entry, setting.label))
        return {"samples_per_s": 100.0, "gen_tokens_per_s": 400.0, "useful_tokens_per_s": 400.0,
                "gen_tokens_per_row": 4.0, "group_s_per_step": {"actor_ranks": 0.2, "rollout_ranks": 0.1}}

    monkeypatch.setattr(bench_e2e, "run_entry", fake_run)
    monkeypatch.setattr(bench_e2e, "warm_up", lambda a, out: {"model": str(tmp_path), "warmup_steps": 1,
                                                              "accuracy": 0.2, "reused": True})
    monkeypatch.setattr(bench_e2e, "plot", lambda *args, **kw: None)
    monkeypatch.setattr(bench_e2e, "code_version", lambda: None)
    bench_e2e.main(["--modes", "sync,stream,async", "--no-trl", "--no-sweep", "--reps", "4", "--out", str(tmp_path)])
    s = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert not [c for c in calls if c[0].startswith("pass")] and s["sweep"] == {}
    assert {c["label"] for c in s["settings"].values()} == {"auto_reward_actor"}
    assert s["reps"] == 6 and s["reps_requested"] == 4  # raised to a multiple of the 3 entries
    assert s["carryover_balanced"] is True  # 6 = a whole Williams design of 3
    # stream and async share one stand-alone configuration: one run bounds both
    assert len([c for c in calls if c[0] == "standalone"]) == 1


def test_a_run_that_failed_after_its_summary_counts_with_the_failure_named(tmp_path, monkeypatch):
    # the report after the RL phase may fail (a lapsed heartbeat on a loaded machine): the RL
    # figures are complete; a run that failed before its summary does not count
    import shutil
    src = _run_dir(tmp_path, "rollout")

    def fake_train(name, overrides, run_dir, timeout_s, memory=None):
        if name == "async":
            shutil.copytree(src, run_dir)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)  # the retry's directory (train() makes it afresh)
        log = run_dir.parent / f"{name}.log"
        log.write_text("worker rank 1 exits: the driver's heartbeat stopped 10.4s ago\n")
        return 1, 5.0, log

    monkeypatch.setattr(bench_e2e, "train", fake_train)
    a = _args(ref_with="rollout", steps=2, seed=0, batch_prompts=16, num_eval=8, run_timeout_s=10.0)
    r = bench_e2e.run_mode("async", bench_e2e.Setting(0, "rollout"), a, tmp_path / "rep0", tmp_path)
    assert r["samples_per_s"] == 100.0 and "heartbeat" in r["exit_after_summary"] and r["attempts"] == 1
    r = bench_e2e.run_mode("sync", bench_e2e.Setting(0, "rollout"), a, tmp_path / "rep1", tmp_path)
    assert "error" in r and "exit 1" in r["error"]
