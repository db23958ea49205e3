"""reward.name=data_source: verl's default routing by the record's data_source for the common
math sets: GSM8K's '####' answers, MATH's last \\boxed{} through math-verify."""
from __future__ import annotations

import pytest

from asyncflow.rewards import RewardError, RewardRunner
from asyncflow.rewards.data_source import boxed_math_score, gsm8k_score, unrouted


@pytest.mark.parametrize("response,answer,score", [
    ("3 + 4 = 7 apples\n#### 7", "7", 1.0),
    ("It costs #### $1,200", "1200", 1.0),
    ("#### 12 then again #### 13", "13", 1.0),  # the last marker
    ("#### 12 then again #### 13", "12", 0.0),
    ("#### -3.5", "-3.50", 1.0),
    ("The answer is 7", "7", 0.0),  # no '####': verl's strict rule scores 0
    ("\\boxed{7}", "7", 0.0),
    ("#### seven", "7", 0.0),
])
def test_gsm8k(response, answer, score):
    assert gsm8k_score(response, answer) == score


@pytest.mark.parametrize("response,answer,score", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # symbolic, through math-verify
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
    ("\\boxed{5}", "The answer is $\\boxed{5}$", 1.0),  # a boxed reference
    ("the answer is 5", "5", 0.0),  # no \\boxed: 0
    ("\\boxed{6}", "5", 0.0),
])
def test_boxed_math(response, answer, score):
    assert boxed_math_score(response, answer) == score


def test_rows_are_routed_by_their_data_source():
    metas = [{"data_source": "openai/gsm8k"}, {"data_source": "DigitalLearningGmbH/MATH-lighteval"},
             {"data_source": "lighteval/MATH"}, {"data_source": "openai/gsm8k"}]
    responses = ["#### 7", "\\boxed{7}", "#### 7", "\\boxed{7}"]
    scores, stats = RewardRunner("data_source").score(responses, ["7"] * 4, metas)
    assert scores == [1.0, 1.0, 0.0, 0.0] and stats["errors"] == 0


@pytest.mark.parametrize("meta,match", [
    ({"data_source": "my/set"}, r"no rule for data_source 'my/set'; known: openai/gsm8k, .*reward.custom_path"),
    ({}, r"no rule for a row without data_source"),
])
def test_a_row_without_a_rule_stops_scoring_naming_it(meta, match):
    runner = RewardRunner("data_source", on_error="zero")
    with pytest.raises(RewardError, match=r"reward 'data_source' failed on row 1: RewardContractError: .*" + match):
        runner.score(["#### 1", "#### 1"], ["1", "1"], [{"data_source": "openai/gsm8k"}, meta])


def test_unrouted_lists_each_unknown_source_once():
    assert unrouted(["openai/gsm8k", "x", None, "x", "lighteval/MATH"]) == ["x", None]
