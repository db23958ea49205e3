"""perf/bench_e2e.py's ideal bound: which ranks a stage's cost is charged to follows the
run's placement (reference with the actor or with the rollout rank)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_e2e  # noqa: E402

ROWS = 64


def _run_dir(tmp: Path, ref_with: str) -> Path:
    """Two steps of an async run: rank 0 updates for 0.2 s a step, rank 1 generates for 0.1 s;
    the reference forward (0.1 s) runs on whichever rank the placement names."""
    ref_rank = 0 if ref_with == "actor" else 1
    d = tmp / ref_with
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"samples_per_s": 100.0, "tokens_per_s": 1000.0, "rl_s": 1.28,
                                                "rl_steps": 2, "staleness_mean": 1.0, "staleness_max": 1}))
    (d / "config.json").write_text(json.dumps({"placement": {"mode": "disaggregated", "actor_ranks": [0],
                                                             "rollout_ranks": [1], "reward_with": "actor",
                                                             "ref_with": ref_with}}))
    steps = [{"perf/samples_per_s": 100.0, "time_s": 1.0 + i, "timing_s/update": 0.2, "timing_s/rollout": 0.1,
              "timing_s/ref_log_prob": 0.1} for i in range(2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    spans = []
    for i in range(2):
        t = float(i)
        spans += [{"lane": "rank1 rollout0", "stage": "rollout", "start": t, "end": t + 0.1},
                  {"lane": f"rank{ref_rank} ref", "stage": "ref_log_prob", "start": t + 0.1, "end": t + 0.2},
                  {"lane": "rank0 actor", "stage": "update", "start": t + 0.3, "end": t + 0.5}]
    (d / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return d


@pytest.mark.parametrize("ref_with, actor_s, rollout_s", [("actor", 0.3, 0.1), ("rollout", 0.2, 0.2)])
def test_reference_cost_goes_to_the_ranks_it_ran_on(tmp_path, ref_with, actor_s, rollout_s):
    a = argparse.Namespace(prompts=16, group=4, max_new_tokens=48)
    r = bench_e2e.analyse(_run_dir(tmp_path, ref_with), "async", a)
    assert r["group_s_per_step"] == pytest.approx({"actor_ranks": actor_s, "rollout_ranks": rollout_s})
    assert r["bound_samples_per_s"] == pytest.approx(ROWS / max(actor_s, rollout_s))


def test_disaggregated_modes_share_one_placement():
    a = argparse.Namespace(ref_with="rollout")
    for name in ("sync", "stream", "async"):
        assert bench_e2e.placement_overrides(bench_e2e.MODES[name], a) == ["placement.ref_with=rollout"]
    assert bench_e2e.placement_overrides(bench_e2e.MODES["sync_colocated"], a) == []
