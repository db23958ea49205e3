"""Advantage estimators: hand-computed values and properties."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import ADVANTAGES, GROUP_RELATIVE_ADVANTAGES, discounted_returns, outcome_to_token_rewards
from asyncflow.algorithms.advantages import dr_grpo, gae, grpo, reinforce_pp, rloo
from asyncflow.config import AlgorithmConfig

CFG = AlgorithmConfig()


def _outcome(scores: list[float], lengths: list[int], t: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return outcome_to_token_rewards(torch.tensor(scores), mask), mask


def test_outcome_to_token_rewards_puts_score_on_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    out = outcome_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    # row 2 has no real token: its score is dropped; row 3's last real token is index 2
    assert_close(out, torch.tensor([[0.0, 1, 0], [0, 0, 2], [0, 0, 0], [0, 0, 4]]))
    assert outcome_to_token_rewards(torch.tensor([1, 0]), mask[:2]).is_floating_point()
    with pytest.raises(ValueError, match=r"scores must have shape \(4,\)"):
        outcome_to_token_rewards(torch.ones(3), mask)


def test_grpo_by_hand() -> None:
    # default (verl's): the std with Bessel's correction
    # group 7: scores [1, 0] -> mean 0.5, std sqrt(0.5) -> [+0.7071, -0.7071]
    # group 3: scores [1, 2, 3] -> mean 2, std 1 -> [-1, 0, 1]
    # group 9: a single response -> 0 (no baseline; verl would give score / (1 + eps))
    r, m = _outcome([1, 1, 0, 2, 3, 5], [2, 3, 4, 1, 2, 3])
    gid = torch.tensor([7, 3, 7, 3, 3, 9])
    adv, ret = grpo(r, m, group_ids=gid, cfg=AlgorithmConfig(eps=1e-12))
    h = math.sqrt(0.5)
    assert_close(adv, torch.tensor([h, -1.0, -h, 0.0, 1.0, 0.0]).unsqueeze(1) * m)  # real tokens only
    # returns: gamma = 1 return-to-go of the outcome = the score on every real token
    assert_close(ret, torch.tensor([1.0, 1, 0, 2, 3, 5]).unsqueeze(1) * m)
    # unbiased_std=False: the population std. group 7: std 0.5 -> [+1, -1];
    # group 3: std sqrt(2/3) -> [-1.2247, 0, 1.2247]
    adv, _ = grpo(r, m, group_ids=gid, cfg=AlgorithmConfig(eps=1e-12, unbiased_std=False))
    s = math.sqrt(2 / 3)
    assert_close(adv, torch.tensor([1.0, -1 / s, -1.0, 0.0, 1 / s, 0.0]).unsqueeze(1) * m)


def _verl_grpo(scores: torch.Tensor, gid: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """verl's compute_grpo_outcome_advantage, group by group (groups of >= 2 members)."""
    out = torch.empty_like(scores)
    for g in gid.unique():
        s = scores[gid == g]
        out[gid == g] = (s - s.mean()) / (s.std() + eps)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_grpo_matches_verl_for_groups_of_two_or_more(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gid = torch.arange(6).repeat_interleave(torch.randint(2, 6, (6,), generator=gen))
    gid = gid[torch.randperm(len(gid), generator=gen)]  # members of a group are not adjacent
    scores = torch.randn(len(gid), generator=gen, dtype=dtype)
    mask = torch.ones(len(gid), 3, dtype=torch.bool)
    adv, _ = grpo(outcome_to_token_rewards(scores, mask), mask, group_ids=gid)
    assert adv.dtype == dtype
    assert_close(adv[:, 0], _verl_grpo(scores, gid))
    assert_close(adv, adv[:, :1].expand(-1, 3).contiguous())


EQUAL_VALUES = [0.1, 1 / 3, 1e7 + 0.1, -2.7, 0.0, 5.0, 1e-30]


@pytest.mark.parametrize("name", sorted(GROUP_RELATIVE_ADVANTAGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", [AlgorithmConfig(), AlgorithmConfig(unbiased_std=False),
                                 AlgorithmConfig(norm_std=False), AlgorithmConfig(eps=1e-30)],
                         ids=["unbiased", "population", "no_std", "tiny_eps"])
def test_equal_group_gives_exactly_zero(name: str, dtype: torch.dtype, cfg: AlgorithmConfig) -> None:
    # One group per value, 7 members each (7 * 0.1 / 7 != 0.1 in floating point), interleaved,
    # with different lengths; plus a group with spread, which must not disturb the others.
    n = 7
    values = [v for v in EQUAL_VALUES for _ in range(n)] + [0.1, 0.2, 0.3]
    gid = torch.tensor([i for i in range(len(EQUAL_VALUES)) for _ in range(n)] + [99, 99, 99])
    order = torch.randperm(len(values), generator=torch.Generator().manual_seed(0))
    scores = torch.tensor(values, dtype=dtype)[order]
    gid = gid[order]
    lengths = torch.arange(len(values)) % 4 + 1
    mask = torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)
    adv, _ = ADVANTAGES.get(name)(outcome_to_token_rewards(scores, mask), mask, group_ids=gid, cfg=cfg)
    equal = gid != 99
    assert (adv[equal] == 0).all(), adv[equal].abs().max()
    assert (adv[~equal][:, 0].abs() > 0.05).sum() == 2  # the spread group: its outer members


@pytest.mark.parametrize("name", sorted(GROUP_RELATIVE_ADVANTAGES))
def test_single_member_group_gives_zero(name: str) -> None:
    r, m = _outcome([0.7, -3.0, 1.0, 2.0], [1, 2, 3, 4])
    adv, _ = ADVANTAGES.get(name)(r, m, group_ids=torch.tensor([0, 1, 2, 2]))
    assert (adv[:2] == 0).all()
    assert (adv[2:, 0] != 0).all()


def test_group_deviations_keep_precision_at_large_offsets() -> None:
    # float64 scores 1e9 + [0.1, 0.2, 0.3]: deviations from the first member are exact to ~1e-7,
    # while (score - sum / n) would lose the digits to the offset's rounding.
    scores = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64) + 1e9
    m = torch.ones(3, 1, dtype=torch.bool)
    adv, _ = dr_grpo(scores.unsqueeze(1), m, group_ids=torch.zeros(3, dtype=torch.long))
    assert_close(adv[:, 0], torch.tensor([-0.1, 0.0, 0.1], dtype=torch.float64), atol=1e-6, rtol=0)


def test_group_relative_advantages_are_registered_group_estimators() -> None:
    assert GROUP_RELATIVE_ADVANTAGES == {"grpo", "dr_grpo", "rloo"}
    assert GROUP_RELATIVE_ADVANTAGES <= set(ADVANTAGES.names())
    r, m = _outcome([1.0, 0.0], [2, 2])
    for name in ADVANTAGES.names():  # exactly the estimators that need group_ids
        needs = False
        try:
            ADVANTAGES.get(name)(r, m, values=torch.zeros(2, 4))
        except ValueError as e:
            needs = "needs group_ids" in str(e)
        assert needs == (name in GROUP_RELATIVE_ADVANTAGES), name


def test_grpo_without_std_equals_dr_grpo_and_dr_grpo_ignores_norm_std() -> None:
    r, m = _outcome([1, 1, 0, 2, 3, 5], [2, 3, 4, 1, 2, 3])
    gid = torch.tensor([0, 1, 0, 1, 1, 2])
    a1, _ = grpo(r, m, group_ids=gid, cfg=AlgorithmConfig(norm_std=False))
    a2, _ = dr_grpo(r, m, group_ids=gid, cfg=AlgorithmConfig(norm_std=True))
    assert_close(a1, a2)
    # group 0: [1, 0] -> [0.5, -0.5]; group 1: [1, 2, 3] -> [-1, 0, 1]
    assert_close(a2[:, 0], torch.tensor([0.5, -1, -0.5, 0, 1, 0]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", range(3))
def test_group_advantages_sum_to_zero_per_group(name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 24, 6
    gid = torch.randint(0, 5, (b,), generator=gen) * 11  # sparse, unordered ids
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    r = outcome_to_token_rewards(torch.randn(b, generator=gen), mask)
    adv, _ = ADVANTAGES.get(name)(r, mask, group_ids=gid, cfg=CFG)
    per_seq = adv[:, 0]
    for g in gid.unique():
        assert per_seq[gid == g].sum().abs().item() < 1e-5
    assert (adv[~mask] == 0).all()
    # the advantage is constant over each sequence's real tokens
    assert_close(adv, per_seq.unsqueeze(1) * mask)


def test_grpo_constant_group_gives_zero_not_nan() -> None:
    r, m = _outcome([1, 1, 1], [1, 2, 3])
    adv, _ = grpo(r, m, group_ids=torch.tensor([0, 0, 0]), cfg=CFG)
    assert (adv == 0).all()


def test_rloo_by_hand() -> None:
    # group 0 scores [1, 0, 2]: 1 - (0+2)/2 = 0; 0 - (1+2)/2 = -1.5; 2 - (1+0)/2 = 1.5
    # group 1 has one member: 0
    r, m = _outcome([1, 0, 2, 4], [1, 2, 3, 4])
    adv, _ = rloo(r, m, group_ids=torch.tensor([0, 0, 0, 1]), cfg=CFG)
    assert_close(adv[:, 0], torch.tensor([0.0, -1.5, 1.5, 0.0]))


def test_rloo_is_scaled_dr_grpo() -> None:
    # score_i - mean_others = n/(n-1) * (score_i - mean_all)
    gen = torch.Generator().manual_seed(0)
    r, m = _outcome(torch.randn(8, generator=gen).tolist(), [4] * 8)
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a_rloo, _ = rloo(r, m, group_ids=gid, cfg=CFG)
    a_dr, _ = dr_grpo(r, m, group_ids=gid, cfg=CFG)
    assert_close(a_rloo, a_dr * 4 / 3)


def test_discounted_returns_by_hand_with_gap_and_padding() -> None:
    # gamma 0.5. row 0: rewards [0, 0, 1] -> [0.25, 0.5, 1]
    # row 1: position 1 is masked (tool output): its reward 5 is ignored and it costs no discount
    #        -> [0.5 * 1, 0, 1]; position 3 is padding.
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 5.0, 1.0, 9.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    assert_close(discounted_returns(r, m, 0.5),
                               torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.5, 0.0, 1.0, 0.0]]))


def test_reinforce_pp_by_hand() -> None:
    # gamma 0.5: row 0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; row 1 rewards [0, 2, pad] -> [1, 2, 0]
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expected_ret = torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    adv, ret = reinforce_pp(r, m, cfg=AlgorithmConfig(gamma=0.5, whiten=False))
    assert_close(ret, expected_ret)
    assert_close(adv, expected_ret)
    # whitened over the 5 real tokens {0.25, 0.5, 1, 1, 2}: mean 0.95, deviations
    # [-0.7, -0.45, 0.05, 0.05, 1.05], squares sum 1.8 -> population var 1.8 / 5 = 0.36
    adv, _ = reinforce_pp(r, m, cfg=AlgorithmConfig(gamma=0.5, eps=1e-12, unbiased_std=False))
    std = 0.6
    expected = (expected_ret - 0.95) / std * m
    assert_close(adv, expected)
    assert adv[m.bool()].mean().abs().item() < 1e-6
    # default (verl's masked_whiten): unbiased variance 1.8 / 4 = 0.45
    adv, _ = reinforce_pp(r, m, cfg=AlgorithmConfig(gamma=0.5, eps=1e-12))
    assert_close(adv, (expected_ret - 0.95) / math.sqrt(0.45) * m)
    # equal returns whiten to exactly 0
    adv1, _ = reinforce_pp(torch.tensor([[0.0, 0.0, 0.1], [0.0, 0.0, 0.1]]), torch.ones(2, 3))
    assert (adv1 == 0).all()


def test_gae_by_hand() -> None:
    # r = [0, 0, 1], V = [0.5, 0.5, 0.5], gamma 0.9, lam 0.5, V after the last token = 0:
    # t2: delta = 1 - 0.5 = 0.5;               A2 = 0.5
    # t1: delta = 0 + 0.9*0.5 - 0.5 = -0.05;   A1 = -0.05 + 0.45*0.5   = 0.175
    # t0: delta = -0.05;                       A0 = -0.05 + 0.45*0.175 = 0.02875
    # returns = A + V
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    m = torch.ones(1, 3)
    adv, ret = gae(r, m, values=v, cfg=AlgorithmConfig(gamma=0.9, lam=0.5, whiten=False))
    assert_close(adv, torch.tensor([[0.02875, 0.175, 0.5]]))
    assert_close(ret, torch.tensor([[0.52875, 0.675, 1.0]]))


def test_gae_ignores_padding_values_and_skips_gaps() -> None:
    # row 0: r [0, 1, pad], V [.5, .5, 99]: 99 is padding, V after the end is 0 -> A = [.5, .5, 0]
    # row 1: position 1 masked (garbage V = 42) is skipped: same as the 2-token sequence [0, 1]
    r = torch.tensor([[0.0, 1.0, 3.0], [0.0, 8.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 99.0], [0.5, 42.0, 0.5]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv, ret = gae(r, m, values=v, cfg=AlgorithmConfig(whiten=False))
    assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5]]))
    assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]))


def test_gae_with_lam_1_is_return_minus_value_and_whitening() -> None:
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(5, 7, generator=gen)
    v = torch.randn(5, 7, generator=gen)
    m = torch.arange(7).unsqueeze(0) < torch.tensor([[7], [3], [1], [5], [6]])
    adv, ret = gae(r, m, values=v, cfg=AlgorithmConfig(gamma=0.95, lam=1.0, whiten=False))
    assert_close(adv, (discounted_returns(r, m, 0.95) - v) * m)
    assert_close(ret, discounted_returns(r, m, 0.95))
    adv_w, ret_w = gae(r, m, values=v, cfg=AlgorithmConfig(gamma=0.95, lam=1.0, unbiased_std=False))
    assert_close(ret_w, ret)  # returns come from the unwhitened advantages
    assert adv_w[m].mean().abs().item() < 1e-5
    assert adv_w[m].pow(2).mean().item() == pytest.approx(1.0, abs=1e-4)  # population std: unit RMS
    adv_u, _ = gae(r, m, values=v, cfg=AlgorithmConfig(gamma=0.95, lam=1.0))  # default: unbiased std
    assert adv_u[m].var().item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"])
def test_uniform_signature_padding_and_no_grad(name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    r = outcome_to_token_rewards(torch.randn(4, generator=gen), m).requires_grad_(True)
    v = torch.randn(4, 4, generator=gen, requires_grad=True)
    gid = torch.tensor([0, 0, 1, 1])
    adv, ret = ADVANTAGES.get(name)(r, m, group_ids=gid, values=v, cfg=CFG)
    assert adv.shape == ret.shape == (4, 4)
    assert not adv.requires_grad and not ret.requires_grad
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()
    # garbage in padding changes nothing
    r2, v2 = r.detach().clone(), v.detach().clone()
    r2[m == 0] = float("nan")
    v2[m == 0] = float("inf")
    adv2, ret2 = ADVANTAGES.get(name)(r2, m, group_ids=gid, values=v2, cfg=CFG)
    assert_close(adv2, adv)
    assert_close(ret2, ret)


def test_errors_name_the_problem() -> None:
    r, m = _outcome([1, 0], [2, 3])
    for fn in (grpo, dr_grpo, rloo):
        with pytest.raises(ValueError, match="needs group_ids"):
            fn(r, m, cfg=CFG)
    with pytest.raises(ValueError, match=r"group_ids must have shape \(2,\)"):
        grpo(r, m, group_ids=torch.tensor([0, 0, 1]), cfg=CFG)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        grpo(r, m, group_ids=torch.tensor([0.0, 1.0]), cfg=CFG)
    with pytest.raises(ValueError, match="gae needs values"):
        gae(r, m, cfg=CFG)
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\) but token_rewards has shape \(2, 4\)"):
        gae(r, m, values=torch.zeros(2, 3), cfg=CFG)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\) but token_rewards has shape \(2, 4\)"):
        reinforce_pp(r, m[:, :3], cfg=CFG)
    with pytest.raises(ValueError, match="float tensor"):
        reinforce_pp(r.long(), m, cfg=CFG)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered: dr_grpo, gae"):
        ADVANTAGES.get("ppo")


@pytest.mark.parametrize("kwargs", [{"gamma": 1.5}, {"lam": -0.1}, {"eps": 0.0}, {"gamma": float("nan")}])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"])
def test_config_validation_names_the_key(kwargs: dict, name: str) -> None:
    (key, value), = kwargs.items()
    r, m = _outcome([1, 0], [2, 3])
    with pytest.raises(ValueError, match=rf"algorithm\.{key}: must be"):
        ADVANTAGES.get(name)(r, m, group_ids=torch.tensor([0, 0]), values=torch.zeros(2, 4),
                             cfg=AlgorithmConfig(**kwargs))
