"""perf/convergence.py's pure logic: seeds and settings, the rotating order, median and spread over
seeds, the ratio per seed then its median, the within-noise rule, and the curves read from a run's
files (small made-up run directories; no training)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "perf" / "convergence.py"
_spec = importlib.util.spec_from_file_location("perf_convergence", _PATH)
conv = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = conv
_spec.loader.exec_module(conv)


# ---- seeds, settings, overrides ----------------------------------------------------------------

def test_seeds_parse_and_refuse_repeats_and_junk():
    assert conv.parse_seeds("0,1,2") == [0, 1, 2]
    assert conv.parse_seeds(" 7 , 3") == [7, 3]
    with pytest.raises(ValueError, match="repeated"):
        conv.parse_seeds("1,1")
    with pytest.raises(ValueError, match="integers"):
        conv.parse_seeds("0,x")
    with pytest.raises(ValueError, match="no seed"):
        conv.parse_seeds(",")


def test_default_settings_are_sync_and_the_main_jobs_async():
    assert conv.DEFAULT_SETTINGS == ("sync", "async")
    # "async" is the grpo recipe as shipped: every value it names is the recipe's own default
    from asyncflow.config import load_config
    cfg = load_config(Path(conv.ROOT) / "recipes" / "grpo" / "config.yaml")
    assert (cfg.workflow.mode, cfg.workflow.max_staleness, cfg.rollout.partial_rollout) == ("async", 1, False)
    assert set(conv.SETTINGS["async"]) == {"workflow.mode=async", "workflow.max_staleness=1",
                                           "rollout.partial_rollout=false"}
    assert "rollout.partial_rollout=true" in conv.SETTINGS["async_partial"]  # available, not default
    assert "workflow.max_staleness=2" in conv.SETTINGS["async_s2"]
    assert conv.parse_settings("sync,async_partial") == ["sync", "async_partial"]
    with pytest.raises(ValueError, match="unknown"):
        conv.parse_settings("sync,async_s3")


def test_overrides_may_not_take_the_seed_or_the_output_directory():
    conv.check_overrides(["trainer.prompts_per_step=16", "rollout.n=4"], conv.OWNED_KEYS)
    with pytest.raises(ValueError, match="--seeds"):
        conv.check_overrides(["trainer.seed=3"], conv.OWNED_KEYS)
    with pytest.raises(ValueError, match="key=value"):
        conv.check_overrides(["trainer.steps"], conv.OWNED_KEYS)


def test_run_limits_stop_every_run_at_the_same_steps_or_the_same_rl_seconds():
    assert conv.run_limits(1500, 0) == ["trainer.steps=1500", "trainer.time_budget_s=0"]
    assert conv.run_limits(100000, 780) == ["trainer.steps=100000", "trainer.time_budget_s=780"]


def test_a_negative_time_budget_is_refused(capsys):
    with pytest.raises(SystemExit):
        conv.main(["--time-budget", "-5"])
    assert "--time-budget -5: must be >= 0" in capsys.readouterr().err


# ---- rotation ---------------------------------------------------------------------------------

def test_rotation_starts_each_seed_one_setting_later():
    assert conv.rotation(["A", "B", "C"], 3) == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]
    assert conv.rotation(["A", "B", "C"], 2) == [["A", "B", "C"], ["B", "C", "A"]]
    assert conv.rotation(["A", "B"], 3)[2] == ["A", "B"]  # wraps after a full cycle


def test_rotation_puts_every_setting_in_every_slot_once_per_cycle():
    names = list(conv.DEFAULT_SETTINGS)
    orders = conv.rotation(names, len(names))
    for slot in range(len(names)):
        assert sorted(o[slot] for o in orders) == sorted(names)


@pytest.mark.parametrize("names, count", [([], 3), (["A"], 0)])
def test_rotation_refuses_nothing_to_order(names, count):
    with pytest.raises(ValueError, match="rotation"):
        conv.rotation(names, count)


# ---- median, spread, ratios, noise --------------------------------------------------------------

def test_spread_is_median_and_range_over_seeds():
    s = conv.spread({0: 3.0, 1: 1.0, 2: 2.0})
    assert (s.median, s.lo, s.hi) == (2.0, 1.0, 3.0)
    assert s.as_json() == {"median": 2.0, "min": 1.0, "max": 3.0, "per_seed": {"0": 3.0, "1": 1.0, "2": 2.0}}
    assert conv.spread({0: 1.0, 1: 4.0}).median == 2.5


def test_spread_leaves_nan_out_and_refuses_nothing():
    assert conv.spread({0: float("nan"), 1: 2.0}).per_seed == {1: 2.0}
    with pytest.raises(ValueError, match="no values"):
        conv.spread({0: float("nan")})
    assert conv.maybe_spread({}) is None


def test_ratio_is_taken_per_seed_then_the_median():
    asy = {0: 300.0, 1: 200.0, 2: 500.0}
    syn = {0: 100.0, 1: 400.0, 2: 250.0}
    ratios = conv.per_seed_ratios(asy, syn)
    assert ratios == {0: 3.0, 1: 0.5, 2: 2.0}
    assert conv.spread(ratios).median == 2.0
    # not the ratio of the medians (300 / 250 = 1.2): a slow spell on one seed must not mix seeds
    assert conv.spread(ratios).median != conv.spread(asy).median / conv.spread(syn).median


def test_ratio_skips_seeds_missing_on_either_side():
    assert conv.per_seed_ratios({0: 2.0, 1: 3.0}, {1: 1.0, 2: 1.0}) == {1: 3.0}
    assert conv.per_seed_ratios({0: 2.0}, {0: 0.0}) == {}


def test_within_noise_is_inside_the_reference_range_inclusive():
    ref = conv.spread({0: 0.20, 1: 0.30, 2: 0.25})
    assert conv.within_noise(0.20, ref) and conv.within_noise(0.30, ref) and conv.within_noise(0.27, ref)
    assert not conv.within_noise(0.19, ref)
    assert not conv.within_noise(0.31, ref)


def test_tail_mean_is_the_last_fifth():
    assert conv.tail_mean([0.0] * 8 + [1.0, 3.0]) == 2.0
    assert conv.tail_mean([5.0, 1.0, 2.0]) == 2.0  # at least one value
    assert math.isnan(conv.tail_mean([]))


# ---- curves from a run's files --------------------------------------------------------------------

def make_run(root: Path, rows_per_step: list[int], rewards: list[float], evals: list[tuple[str, int, float]],
             samples_per_s: float = 100.0, staleness: float = 0.5) -> Path:
    """A made-up finished run: metrics.jsonl, samples.jsonl and summary.json as the trainer writes them."""
    root.mkdir(parents=True)
    metrics = [{"step": 0, "time_s": 1.0, "eval/accuracy": evals[0][2], "phase": "before_rl", "eval/version": 0}]
    metrics += [{"step": t + 1, "time_s": 1.0 + t + 1, "step_time_s": 1.0, "reward/mean": r, "actor/loss": 0.0}
                for t, r in enumerate(rewards)]
    metrics += [{"step": v, "eval/accuracy": a, "phase": ph, "eval/version": v} for ph, v, a in evals[1:]]
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    samples = [{"step": t, "uid": 0, "score": 1.0} for t, n in enumerate(rows_per_step) for _ in range(n)]
    (root / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (root / "summary.json").write_text(json.dumps({"samples_per_s": samples_per_s, "rl_s": 10.0,
                                                    "staleness_mean": staleness}))
    return root


def test_curves_put_reward_and_accuracy_at_the_samples_seen(tmp_path):
    run = make_run(tmp_path / "run", rows_per_step=[8, 4, 6, 2], rewards=[0.1, 0.2, 0.3, 0.4],
                   evals=[("before_rl", 0, 0.2), ("rl", 2, 0.25), ("after_rl", 4, 0.3)])
    c = conv.read_curves(run)
    assert [(p.samples, p.reward, p.step) for p in c.reward] == [(8, 0.1, 1), (12, 0.2, 2), (18, 0.3, 3),
                                                                (20, 0.4, 4)]
    # the policy after 2 updates had trained on steps 0 and 1's rows
    assert [(e.samples, e.accuracy, e.phase, e.version) for e in c.evals] == [
        (0, 0.2, "before_rl", 0), (12, 0.25, "rl", 2), (20, 0.3, "after_rl", 4)]
    assert (c.samples, c.trained_steps) == (20, 4)


def test_a_step_whose_groups_were_all_dropped_adds_no_samples_and_no_reward(tmp_path):
    run = make_run(tmp_path / "run", rows_per_step=[8, 0, 4], rewards=[0.1, 0.2, 0.3],
                   evals=[("before_rl", 0, 0.2), ("after_rl", 3, 0.3)], samples_per_s=50.0)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics if m["step"] != 2 or "phase" in m))
    c = conv.read_curves(run)
    assert [(p.samples, p.step) for p in c.reward] == [(8, 1), (12, 3)]
    assert c.evals[-1].samples == 12 and (c.samples, c.trained_steps) == (12, 2)
    r = conv.run_result(c, {"samples_per_s": 50.0, "rl_steps": 3}, 1.0)
    assert (r.rl_steps, r.trained_steps) == (3, 2)


def test_run_result_takes_samples_per_s_from_the_summary(tmp_path):
    run = make_run(tmp_path / "run", [4] * 10, [0.0] * 8 + [0.5, 1.0],
                   [("before_rl", 0, 0.2), ("rl", 5, 0.4), ("after_rl", 10, 0.3)], samples_per_s=321.0)
    r = conv.run_result(conv.read_curves(run), json.loads((run / "summary.json").read_text()), 12.0)
    assert r.samples_per_s == 321.0
    assert r.reward_last20 == 0.75
    assert (r.accuracy_before, r.final_accuracy, r.best_accuracy) == (0.2, 0.3, 0.4)
    assert (r.samples, r.trained_steps, r.wall_s) == (40, 10, 12.0)
    with pytest.raises(ValueError, match="no samples_per_s"):
        conv.run_result(conv.read_curves(run), {"rl_s": 1.0}, 1.0, where="seed0/sync")


def test_curves_refuse_a_run_without_samples_or_with_a_bad_line(tmp_path):
    run = make_run(tmp_path / "run", [2], [0.5], [("before_rl", 0, 0.1)])
    (run / "samples.jsonl").unlink()
    with pytest.raises(ValueError, match="log_samples"):
        conv.read_curves(run)
    run2 = make_run(tmp_path / "run2", [2], [0.5], [("before_rl", 0, 0.1)])
    with open(run2 / "metrics.jsonl", "a") as f:
        f.write("{truncated\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:3"):
        conv.read_curves(run2)


# ---- the summary over settings and seeds ----------------------------------------------------------

def _result(sps: float, reward: float, before: float = 0.2) -> conv.RunResult:
    return conv.RunResult(samples_per_s=sps, reward_last20=reward, final_accuracy=0.3, best_accuracy=0.4,
                          accuracy_before=before, staleness_mean=0.0, samples=100, rl_steps=10, trained_steps=9,
                          rl_s=1.0, wall_s=2.0)


def test_summary_has_headline_ratios_and_the_noise_verdict():
    results = {"sync": {0: _result(400, 0.20), 1: _result(500, 0.30), 2: _result(450, 0.25)},
               "async": {0: _result(300, 0.26), 1: _result(450, 0.10), 2: _result(540, 0.28)},
               "async_s2": {0: _result(200, 0.50), 1: _result(250, 0.40)}}
    s = conv.summarise(results)
    r1 = s["ratio_async_vs_sync_samples_per_s"]
    assert (r1["median"], r1["min"], r1["max"]) == (0.9, 0.75, 1.2)
    assert r1["per_seed"] == {"0": 0.75, "1": 0.9, "2": 1.2}
    assert s["ratio_async_s2_vs_sync_samples_per_s"]["median"] == 0.5  # seeds 0 and 1 only: 0.5 and 0.5
    assert s["settings"]["async"]["reward_last20"]["median"] == 0.26
    assert s["reward_within_noise"] is True  # 0.26 in [0.20, 0.30]
    assert s["reward_within_noise_per_setting"]["async_s2"] is False  # 0.45 above 0.30
    assert s["settings"]["sync"]["samples_per_s"] == {"median": 450.0, "min": 400.0, "max": 500.0,
                                                      "per_seed": {"0": 400.0, "1": 500.0, "2": 450.0}}


def test_summary_without_sync_has_no_ratio_and_no_verdict():
    s = conv.summarise({"async": {0: _result(300, 0.2)}, "sync": {}})
    assert s["ratio_async_vs_sync_samples_per_s"] is None and s["reward_within_noise"] is None
    assert "sync" not in s["settings"]


def test_same_start_is_checked_per_seed():
    results = {"sync": {0: _result(1, 0, before=0.2), 1: _result(1, 0, before=0.3)},
               "async": {0: _result(1, 0, before=0.2), 1: _result(1, 0, before=0.31)}}
    assert conv.same_start(results) == {0: True, 1: False}


def test_median_curve_aligns_by_index_and_cuts_to_the_shortest():
    a = [(10, 0.1), (20, 0.2), (30, 0.3)]
    b = [(12, 0.3), (22, 0.0)]
    c = [(14, 0.2), (24, 0.4), (34, 0.9)]
    assert conv.median_curve([a, b, c]) == [(12, 0.2), (22, 0.2)]
    assert conv.median_curve([[], []]) == []
    assert conv.moving_mean([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_step_rate_ratio_splits_the_headline_from_the_rows_each_policy_left():
    def run(sps: float, rows: int, steps: int, secs: float) -> conv.RunResult:
        return dataclasses.replace(_result(sps, 0.2), samples=rows, rl_steps=steps, rl_s=secs)
    # async: 200 steps in 25 s keeping 100 rows a step; sync: 200 steps in 40 s keeping 120
    s = conv.summarise({"sync": {0: run(600.0, 24000, 200, 40.0)}, "async": {0: run(800.0, 20000, 200, 25.0)}})
    assert s["ratio_async_vs_sync_steps_per_s"]["median"] == 1.6
    assert s["ratio_async_vs_sync_samples_per_s"]["median"] == pytest.approx(800 / 600, abs=1e-3)
    assert s["settings"]["async"]["rows_per_step"]["median"] == 100.0
    assert s["settings"]["sync"]["steps_per_s"]["median"] == 5.0
    assert math.isnan(dataclasses.replace(_result(1, 0), rl_s=0.0).steps_per_s)
    # the last printed line carries the split too
    head = json.loads(json.dumps(conv.headline(s)))
    assert head["ratio_async_vs_sync_steps_per_s"]["median"] == 1.6
    assert head["step_ratios_vs_sync"]["async"]["median"] == 1.6
    assert head["settings"] == s["settings"]


# ---- time to accuracy and the learning verdict ----------------------------------------------------

def test_the_learning_verdict_times_each_setting_and_compares_at_equal_samples(tmp_path):
    # sync: 4 steps of 10 rows, 1 s each; async: 4 steps of 10 rows, 0.5 s each (make_run writes 1 s
    # per step, so async's times are halved here)
    sync = make_run(tmp_path / "sync", [10] * 4, [0.1, 0.2, 0.3, 0.4],
                    [("before_rl", 0, 0.2), ("rl", 2, 0.55), ("after_rl", 4, 0.72)])
    asyn = make_run(tmp_path / "async", [10] * 3, [0.1, 0.3, 0.5],
                    [("before_rl", 0, 0.2), ("rl", 2, 0.65), ("after_rl", 3, 0.71)])
    rows = [json.loads(x) for x in (asyn / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        if "step_time_s" in m:
            m["time_s"] = 1.0 + 0.5 * m["step"]
    (asyn / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    curves = {"sync": {0: conv.read_curves(sync)}, "async": {0: conv.read_curves(asyn)}}
    results = {n: {0: conv.run_result(c[0], {"samples_per_s": 1.0, "rl_s": 4.0, "rl_steps": 4}, 1.0)}
               for n, c in curves.items()}
    s = conv.summarise(results, curves)
    assert s["time_to_acc_threshold"] == 0.7
    assert s["ratio_time_to_acc_async_vs_sync"]["per_seed"]["0"] == pytest.approx(4.0 / 1.5, abs=1e-3)  # 4 s vs 1.5 s
    assert s["reached"]["sync"] == {"0.5": 1, "0.6": 1, "0.7": 1}
    assert s["time_to_accuracy"]["async"]["0.6"]["rl_s"]["median"] == 1.0
    # equal samples: 30 rows (async trained the fewer); sync's last version within 30 rows is v2
    eq = s["equal_footing"]
    assert eq["sync"]["accuracy_at_equal_samples"]["median"] == 0.55
    assert eq["async"]["accuracy_at_equal_samples"]["median"] == 0.71
    assert eq["sync"]["reward_at_equal_samples"]["median"] == 0.3  # the step at 30 rows, in (24, 30]
    assert s["collapsed"] == {"sync": [], "async": []}
    assert s["accuracy_within_noise"] is False  # 0.71 outside sync's single-seed [0.55, 0.55]
    json.loads(json.dumps(conv.headline(s)))  # the last printed line is JSON


def test_the_ceiling_is_syncs_step_time_over_the_busiest_groups_cost_measured_alone(tmp_path):
    run = tmp_path / "stage_costs"
    run.mkdir()
    placement = {"mode": "disaggregated", "actor_ranks": [0], "rollout_ranks": [1], "reward_with": "rollout"}
    (run / "config.json").write_text(json.dumps({"workflow": {"mode": "sync"}, "placement": placement}))
    (run / "summary.json").write_text(json.dumps({"rl_steps": 2}))
    spans = []
    for step in range(2):  # per step: rollout 0.3 s + reward 0.1 s on rank 1, update 0.4 s + publish 0.1 on rank 0
        t = step * 1.0
        spans += [{"lane": "rank1 rollout0", "stage": "rollout", "start": t, "end": t + 0.3, "step": step},
                  {"lane": "rank1 reward", "stage": "reward", "start": t + 0.3, "end": t + 0.4, "step": step},
                  {"lane": "rank0 actor", "stage": "update", "start": t + 0.4, "end": t + 0.8, "step": step},
                  {"lane": "rank0 actor", "stage": "weight_sync", "start": t + 0.8, "end": t + 0.9, "step": step},
                  # the rollout side's receive is a background copy: not the actor group's cost
                  {"lane": "rank1 rollout0", "stage": "weight_sync", "start": t + 0.8, "end": t + 0.95, "step": step}]
    (run / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    costs = conv.stage_group_costs(run)
    assert costs == {"actor_ranks": pytest.approx(0.5), "rollout_ranks": pytest.approx(0.4)}
    c = conv.Ceiling(2, costs, sync_s_per_step=1.1, async_s_per_step=0.8)
    assert c.ratio == pytest.approx(2.2) and c.measured == pytest.approx(1.375)
    assert c.share == pytest.approx(0.375 / 1.2)  # async gained 0.375 of the 1.2 it could have
    (run / "config.json").write_text(json.dumps({"workflow": {"mode": "async"}, "placement": placement}))
    with pytest.raises(ValueError, match="only in a sync run"):
        conv.stage_group_costs(run)


def test_a_runs_seconds_per_step_over_a_window_are_from_its_step_rows(tmp_path):
    run = make_run(tmp_path / "run", [4] * 6, [0.1] * 6, [("before_rl", 0, 0.2)])
    assert conv.window_s_per_step(run, 4) == pytest.approx(1.0)  # make_run: a step a second from RL's start


def test_per_step_learning_compares_the_steps_each_setting_needed_to_a_reward_level(monkeypatch):
    monkeypatch.setattr(conv, "REWARD_WINDOW", 1)
    monkeypatch.setattr(conv, "REWARD_LEVELS", (0.5,))

    def curves(first_good_step: int) -> conv.Curves:
        pts = [conv.RewardPoint(samples=10 * s, reward=1.0 if s >= first_good_step else 0.0, step=s)
               for s in range(1, 11)]
        return conv.Curves(pts, [], 100, 10, [], {})
    out = conv.per_step_learning({"sync": {0: curves(4)}, "async": {0: curves(5)}})
    assert out["async"]["0.5"]["steps"]["median"] == 5 and out["sync"]["0.5"]["steps"]["median"] == 4
    assert out["async"]["0.5"]["ratio_vs_reference"]["median"] == 0.8  # async needed 25% more steps
    assert out["sync"]["0.5"]["ratio_vs_reference"] is None
