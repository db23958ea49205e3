"""The built-in recipes' driver-side stages are pure functions of a DriverBatch: advantages
computed once per row (group estimators over whole groups, GAE from values, the KL folded
into the reward), the dynamic-sampling filter and DAPO's overlong shaping."""
from __future__ import annotations

import pytest
import torch

from asyncflow.config import AlgorithmConfig
from asyncflow.workflow.driver_stages import advantages, equal_score_filter, overlong_shaping
from asyncflow.workflow.stages import DriverBatch


def _batch(scores, lengths, groups, **extra):
    cols = {"scores": torch.tensor(scores, dtype=torch.float32),
            "response_ids": [torch.arange(n) for n in lengths], **extra}
    return DriverBatch(0, cols, list(groups))


def test_grpo_advantages_are_group_normalised_and_constant_over_tokens():
    out = advantages(AlgorithmConfig())(_batch([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], [3, 1, 2, 4, 2, 1], [7, 7, 7, 9, 9, 9]))
    adv = out["advantages"]
    assert [len(a) for a in adv] == [3, 1, 2, 4, 2, 1]
    assert all(torch.all(a == a[0]) for a in adv)
    # group 7: mean 1/3, Bessel std sqrt(1/3)
    expect = (1.0 - 1 / 3) / ((1 / 3) ** 0.5 + 1e-6)
    assert float(adv[0][0]) == pytest.approx(expect, rel=1e-5)
    assert all(float(a.abs().max()) == 0.0 for a in adv[3:])  # an all-equal group: exactly zero


def test_gae_uses_the_values_column_and_returns_regression_targets():
    algo = AlgorithmConfig(advantage="gae", lam=0.95, whiten=False)
    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5])]
    out = advantages(algo)(_batch([1.0, 0.0], [3, 1], [0, 1], values=values))
    assert [len(a) for a in out["advantages"]] == [3, 1]
    for adv, ret, v in zip(out["advantages"], out["returns"], values):
        assert torch.allclose(ret, adv + v)
    assert float(out["advantages"][1][0]) == pytest.approx(-0.5)


def test_kl_in_reward_needs_the_reference_log_probs():
    algo = AlgorithmConfig(kl_coef=0.5, kl_in_reward=True)
    with pytest.raises(ValueError, match="ref_log_probs"):
        advantages(algo)(_batch([1.0, 0.0], [2, 2], [0, 0]))
    lp = [torch.zeros(2)] * 3
    ref = [torch.zeros(2), torch.full((2,), -1.0), torch.zeros(2)]  # row 1 drifted from the reference
    with_kl = advantages(algo)(_batch([1.0, 0.0, 0.0], [2] * 3, [0] * 3, behav_log_probs=lp, ref_log_probs=ref))
    plain = advantages(AlgorithmConfig())(_batch([1.0, 0.0, 0.0], [2] * 3, [0] * 3))
    assert float(plain["advantages"][1][0]) == float(plain["advantages"][2][0])
    assert float(with_kl["advantages"][1][0]) < float(with_kl["advantages"][2][0])  # the KL costs row 1


def test_equal_score_filter_keeps_whole_groups_with_spread():
    keep = equal_score_filter()(_batch([1, 1, 0, 0, 1, 1], [1] * 6, [0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, False, False, False, False]
    keep = equal_score_filter()(_batch([1, 0, 0, 0, 0.1, 0.1001], [1] * 6, [0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [True, True, False, False, True, True]


def test_overlong_shaping_is_linear_in_the_buffer_and_capped():
    shaped = overlong_shaping(max_new_tokens=8, buffer=4, penalty=1.0)(_batch([1.0] * 5, [2, 4, 5, 6, 8], range(5)))
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.0])
    with pytest.raises(ValueError, match="reward.overlong_buffer"):
        overlong_shaping(max_new_tokens=8, buffer=9, penalty=1.0)


def test_remax_advantage_is_score_minus_the_greedy_baseline():
    from recipes.remax.recipe import remax_advantages
    b = _batch([1.0, 0.0, 1.0], [2, 3, 1], [0, 0, 1], baseline_scores=torch.tensor([0.5, 0.5, 1.0]))
    adv = remax_advantages(b)["advantages"]
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [-0.5, -0.5, -0.5], [0.0]]
