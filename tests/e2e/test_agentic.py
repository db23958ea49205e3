"""Multi-turn, tool-using episodes through the whole pipeline: the calc_tool recipe runs a
few steps in every mode; its trained rows are episodes whose tool text is masked out of the
loss, and the run reports its tool statistics and shows whole episodes as text."""
from __future__ import annotations

import json

import pytest
from _run import ok, train


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "stream", pytest.param("async", marks=pytest.mark.both_stacks)])
def test_calc_tool_recipe_in_every_mode(tmp_path, mode):
    out = tmp_path / "run"
    placement = "colocated" if mode == "stream" else "disaggregated"  # both rollout paths
    ok(train(out, "calc_tool", "trainer.steps=2", f"workflow.mode={mode}", f"placement.mode={placement}",
             "trainer.eval_every=0", "algorithm.dynamic_sampling=false"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["episodes"] >= 2 * 4 * 4
    for key in ("tool_calls_per_episode", "tool_errors", "turns_mean", "eval_accuracy_before_rl",
                "eval_accuracy_after_rl"):
        assert key in summary, key
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 4
    lag = 1 if mode == "async" else 0
    for r in rows:
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["token_versions"])
        # turns may span versions: never going down, the row's version its oldest model token's
        model = [v for v, m in zip(r["token_versions"], r["loss_mask"]) if m]
        assert r["token_versions"] == sorted(r["token_versions"])
        assert r["gen_version"] == min(model) and r["step"] - r["gen_version"] <= lag
        assert r["episode"]["turns"] >= 1 and "text" in r
        if r["episode"]["tool_calls"]:  # the calculator's output is in the row, not trained
            assert 0 in r["loss_mask"] and "[[" in r["text"]
    episodes = (out / "report" / "episodes.md").read_text()
    assert "## Step" in episodes and "reward" in episodes
