"""calc_tool's task as an OpenAI-client agent through the whole pipeline: the rollout instance
serves the policy behind its OpenAI endpoint, the agents' requests are recorded, and the rows
trained are their episodes (the calculator's text masked out of the loss)."""
from __future__ import annotations

import json

import pytest
from _run import ok, train


@pytest.mark.slow
def test_calc_agent_recipe_trains_on_recorded_agent_episodes(tmp_path):
    out = tmp_path / "run"
    ok(train(out, "calc_agent", "trainer.steps=2", "trainer.eval_every=0", "algorithm.dynamic_sampling=false"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["episodes"] >= 2 * 4 * 4
    assert "eval_accuracy_before_rl" in summary and "eval_accuracy_after_rl" in summary
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 4
    for r in rows:
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["token_versions"])
        assert r["loss_mask"][0] == 1 and r["episode"]["turns"] >= 1  # every row starts with a model turn
        assert r["episode"]["requests"] >= r["episode"]["turns"]
        if r["episode"]["tool_calls"]:  # the calculator's output is in the row, not trained
            assert 0 in r["loss_mask"] and "[[" in r["text"]
