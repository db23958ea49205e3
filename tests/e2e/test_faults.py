"""A reward function that hangs or raises, in a real run: a per-call timeout, scored 0 and
counted (reward.on_error=zero), or the run stops with the function, row and cause (fail)."""
from __future__ import annotations

import json

import pytest

from _run import ok, train

pytestmark = pytest.mark.slow
FAULTY = "imports=[tests.e2e._faulty_rewards]"


def test_a_hanging_reward_times_out_scores_zero_and_is_counted(tmp_path):
    out = tmp_path / "run"
    # reward beside the actor: training's reward and the evaluation's (on the rollout rank) run in
    # two processes, and the function hangs once in each
    ok(train(out, "grpo", FAULTY, "reward.name=test_hangs_once", "reward.timeout_s=1", "trainer.steps=2",
             "trainer.eval_every=0", "warmup.max_steps=5", "placement.reward_with=actor"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["reward/timeouts"] >= 1, summary
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval/accuracy"' in x]
    assert sum(e["eval/reward_timeouts"] for e in evals) >= 1, "the evaluation's reward calls are guarded too"
    assert evals[-1]["reward/timeouts"] == summary["reward/timeouts"]


def test_a_raising_reward_under_on_error_fail_stops_the_run_naming_it(tmp_path):
    p = train(tmp_path / "run", "grpo", FAULTY, "reward.name=test_raises", "reward.on_error=fail",
              "trainer.steps=2", "warmup.max_steps=5")
    assert p.returncode != 0
    assert "reward 'test_raises' failed on row 0" in p.stderr and "reward backend unavailable" in p.stderr, \
        p.stderr[-3000:]
