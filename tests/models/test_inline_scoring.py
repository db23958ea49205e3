"""A rollout instance scoring its own rows (placement.reward_with=inline): the scores column
beside the rollout's, through the same RowScorer as the reward stage; bad input names what
is missing."""
from __future__ import annotations

import pytest
import torch


def _result(ids: list[int]):
    from asyncflow.engines.rollout.base import RequestResult
    n = len(ids)
    return RequestResult(0, torch.tensor(ids), torch.zeros(n), torch.full((n,), 3), "stop")


def _scorer(tiny_dir, **reward):
    from asyncflow.config import load_config
    from asyncflow.models import load_tokenizer
    from asyncflow.workers.reward import RowScorer
    cfg = load_config(None, [f"model.path={tiny_dir}", *[f"reward.{k}={v}" for k, v in reward.items()]])
    tok = load_tokenizer(tiny_dir)
    return RowScorer(cfg.reward, tok, {tok.eos_token_id}), tok


def test_scores_are_written_beside_the_rollout_columns(tiny_dir):
    from asyncflow.engines.rollout.columns import result_columns
    from asyncflow.workers.rollout_stream import ScoreContext, scored_columns
    scorer, tok = _scorer(tiny_dir)
    eos = tok.eos_token_id
    results = [_result(tok.encode("42", add_special_tokens=False) + [eos]),
               _result(tok.encode("41", add_special_tokens=False) + [eos])]
    data = {"answer": ["42", "42"], "prompt": ["a", "b"], "metadata": [{}, {}]}
    context = ScoreContext.of(data, 2, "rollout-rank1")
    cols = scored_columns(result_columns, results, 3, ["response_ids", "behav_log_probs", "scores"], "scores",
                          scorer, context)
    assert list(cols) == ["response_ids", "behav_log_probs", "scores"]
    assert cols["scores"].tolist() == [1.0, 0.0]
    assert cols["scores"].tolist() == scorer.score(cols["response_ids"], ["42", "42"]).tolist()
    # rows of two submitted batches written together keep each row's own answer
    both = context.select([1]).answers + context.select([0]).answers
    assert both == ["42", "42"] and context.select([1]).prompts == ["b"]


def test_a_stage_without_the_answer_column_or_without_responses_is_refused(tiny_dir):
    from asyncflow.engines.rollout.base import SamplingParams
    from asyncflow.engines.rollout.columns import result_columns
    from asyncflow.workers.rollout_stream import ScoreContext, scored_columns, stage_params
    with pytest.raises(ValueError, match="reads the 'answer' column"):
        ScoreContext.of({"prompt_ids": [], "seed": []}, 0, "rollout-rank1")
    scorer, _ = _scorer(tiny_dir)
    with pytest.raises(ValueError, match="must also write the responses"):
        scored_columns(result_columns, [_result([1])], 0, ["scores"], "scores", scorer, ScoreContext(["1"]))
    with pytest.raises(ValueError, match="score_into does not apply to episodes"):
        stage_params(SamplingParams(), {"episode": "calc", "score_into": "scores"})


def test_a_reward_that_fails_names_the_scores_column(tiny_dir):
    from asyncflow.engines.rollout.columns import result_columns
    from asyncflow.rewards import REWARDS
    from asyncflow.workers.rollout_stream import ScoreContext, scored_columns

    def broken(response, answer):
        raise ValueError("bad answer format")
    REWARDS["broken_for_test"] = broken
    try:
        scorer, _ = _scorer(tiny_dir, name="broken_for_test", on_error="fail")
        with pytest.raises(RuntimeError, match="scoring 1 rows into 'scores'.*bad answer format"):
            scored_columns(result_columns, [_result([1, 2])], 0, ["response_ids", "scores"], "scores", scorer,
                           ScoreContext(["1"]))
    finally:
        del REWARDS["broken_for_test"]
