"""perf/time_to_accuracy.py: when a run first reached a held-out accuracy, and the figures at equal
samples and equal time (made-up metrics rows; no training)."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "perf" / "time_to_accuracy.py"
_spec = importlib.util.spec_from_file_location("perf_time_to_accuracy", _PATH)
tta = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tta
_spec.loader.exec_module(tta)


def metrics(evals: list[tuple[str, int, float]], step_times: dict[int, float], start: float = 10.0) -> list[dict]:
    """A run's metrics rows: the before_rl row at ``start``, a step row per version, eval rows."""
    rows = [{"step": 0, "time_s": start, "phase": "before_rl", "eval/accuracy": evals[0][2], "eval/version": 0}]
    rows += [{"step": v, "time_s": start + t, "step_time_s": 0.5} for v, t in sorted(step_times.items())]
    # evaluations are written after their version's step row (they run beside training)
    rows += [{"step": v, "time_s": start + step_times.get(v, 0) + 3.0, "phase": ph, "eval/accuracy": a,
              "eval/version": v} for ph, v, a in evals[1:]]
    return rows


def test_thresholds_parse_sorted_and_refuse_out_of_range():
    assert tta.parse_thresholds("0.7,0.5, 0.6") == (0.5, 0.6, 0.7)
    for bad in ("", "0,0.5", "1.2", "x"):
        with pytest.raises(ValueError, match="--thresholds"):
            tta.parse_thresholds(bad)


def test_the_time_of_a_version_is_when_its_update_finished_not_when_it_was_scored():
    rows = metrics([("before_rl", 0, 0.2), ("rl", 2, 0.55), ("rl", 4, 0.72)], {1: 1.0, 2: 2.0, 3: 3.5, 4: 4.0})
    pts = tta.version_points(rows, cum_samples=[0, 10, 20, 30, 40])
    assert [(p.version, p.rl_s, p.samples, p.accuracy) for p in pts] == [
        (0, 0.0, 0, 0.2), (2, 2.0, 20, 0.55), (4, 4.0, 40, 0.72)]
    reach = tta.first_reach(pts, (0.5, 0.6, 0.7, 0.9))
    assert [(r.rl_s, r.samples, r.version) for r in reach] == [(2.0, 20, 2), (4.0, 40, 4), (4.0, 40, 4),
                                                               (None, None, None)]
    assert [r.reached for r in reach] == [True, True, True, False]


def test_a_version_without_its_own_step_row_takes_the_next_one_and_a_start_above_counts_at_zero():
    times = {1: 1.0, 3: 2.5}  # step 2's row is missing (e.g. all its groups were dropped)
    assert tta.version_time(times, 2) == 2.5 and tta.version_time(times, 0) == 0.0
    with pytest.raises(ValueError, match="version 4"):
        tta.version_time(times, 4)
    pts = tta.version_points(metrics([("before_rl", 0, 0.6), ("rl", 2, 0.4)], times), [0, 5, 10, 15])
    assert tta.first_reach(pts, (0.5,))[0].rl_s == 0.0


def test_a_run_without_a_before_rl_row_is_refused():
    with pytest.raises(ValueError, match="before_rl"):
        tta.rl_start_s([{"step": 1, "time_s": 1.0}])


def test_accuracy_at_equal_samples_and_time_is_the_last_version_within_it():
    pts = [tta.VersionPoint(0, 0.0, 0, 0.2), tta.VersionPoint(2, 5.0, 100, 0.4), tta.VersionPoint(4, 9.0, 180, 0.6)]
    assert tta.accuracy_at(pts, samples=150) == 0.4 and tta.accuracy_at(pts, samples=180) == 0.6
    assert tta.accuracy_at(pts, rl_s=4.9) == 0.2 and tta.accuracy_at(pts, rl_s=9.0) == 0.6
    assert math.isnan(tta.accuracy_at(pts[1:], samples=50))
    with pytest.raises(ValueError, match="exactly one"):
        tta.accuracy_at(pts, samples=1, rl_s=1)


def test_reward_at_samples_averages_the_last_fifth_of_them():
    curve = [(10, 0.0), (20, 0.1), (80, 0.5), (90, 0.7), (100, 0.9), (120, 1.0)]
    assert tta.reward_at(curve, 100) == pytest.approx((0.7 + 0.9) / 2)  # samples in (80, 100]
    assert math.isnan(tta.reward_at(curve, 5))


def test_collapse_is_ending_below_the_start():
    p = tta.VersionPoint
    assert tta.collapsed([p(0, 0, 0, 0.25), p(20, 1, 1, 0.6), p(40, 2, 2, 0.04)])
    assert not tta.collapsed([p(0, 0, 0, 0.25), p(20, 1, 1, 0.1), p(40, 2, 2, 0.3)])
    assert not tta.collapsed([p(0, 0, 0, 0.25)])


def _reaches(*times: float | None) -> list:
    return [tta.Reach(t, rl_s=x, samples=None if x is None else 1, version=None if x is None else 1)
            for t, x in zip((0.5, 0.6, 0.7), times)]


def test_the_headline_threshold_is_the_highest_every_seed_of_both_reached():
    sync = {0: _reaches(10, 20, 40), 1: _reaches(12, 24, None)}
    asyn = {0: _reaches(5, 10, 20), 1: _reaches(6, 16, 30)}
    both = {"sync": sync, "async": asyn}
    assert tta.highest_reached_by_all(both, (0.5, 0.6, 0.7), ("sync", "async")) == 0.6
    assert tta.highest_reached_by_all({"sync": {0: _reaches(None, None, None)}, "async": asyn},
                                      (0.5, 0.6, 0.7), ("sync", "async")) is None
    assert tta.reached_counts(sync, (0.5, 0.6, 0.7)) == {"0.5": 2, "0.6": 2, "0.7": 1}
    # per seed: sync's seconds over async's (> 1: async sooner); a seed missing either side is left out
    assert tta.time_ratios(sync, asyn, 1) == {0: 2.0, 1: 1.5}
    assert tta.time_ratios(sync, asyn, 2) == {0: 2.0}


def test_steps_to_reward_waits_for_a_full_window_then_its_mean():
    curve = [(s, 0.0 if s <= 4 else 1.0) for s in range(1, 11)]  # reward 1 from step 5 on
    assert tta.steps_to_reward(curve, 0.5, window=4) == 6  # steps 3-6: 0, 0, 1, 1
    assert tta.steps_to_reward(curve, 1.0, window=4) == 8
    assert tta.steps_to_reward(curve[:3], 0.0, window=4) is None  # never a full window
    assert tta.steps_to_reward(curve, 1.01, window=2) is None
    with pytest.raises(ValueError, match="window"):
        tta.steps_to_reward(curve, 0.5, window=0)
