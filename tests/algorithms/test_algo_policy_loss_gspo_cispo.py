"""GSPO and CISPO: hand-computed values and gradients, the sequence-level gradient, a
transcription of verl's gspo formula from its math, the behaviour-weighted (async) path,
every aggregation mode, and their config keys."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import AGGREGATIONS, aggregate
from asyncflow.algorithms.policy_loss import cispo, gspo
from asyncflow.config import AlgorithmConfig, ConfigError, load_config
from asyncflow.engines.train.base import LossNorm
from asyncflow.workers.actor_loss import RolloutCorr, policy_loss_fn

LN = math.log


def _rows(token_log_ratios: list[list[float]], old: float = LN(0.5)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_probs (a leaf needing grad; 0 at padding), old_log_probs and the mask of ragged rows."""
    width = max(len(r) for r in token_log_ratios)
    mask = torch.tensor([[j < len(r) for j in range(width)] for r in token_log_ratios])
    lr = torch.tensor([r + [0.0] * (width - len(r)) for r in token_log_ratios])
    old_t = torch.where(mask, torch.full_like(lr, old), torch.zeros_like(lr))
    return (old_t + lr).requires_grad_(True), old_t, mask


def _random(seed: int, b: int = 6, t: int = 7, spread: float = 0.4) -> dict[str, torch.Tensor]:
    """Random rows with one advantage per sequence (as GRPO gives)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 3
    mask = torch.arange(t).unsqueeze(0) < torch.randint(1, t + 1, (b, 1), generator=gen)
    return {"log_probs": (old + spread * torch.randn(b, t, generator=gen)).requires_grad_(True),
            "old_log_probs": old, "mask": mask,
            "advantages": torch.randn(b, 1, generator=gen).expand(b, t).clone(),
            "behav": old + 0.3 * torch.randn(b, t, generator=gen)}


# ---- GSPO ------------------------------------------------------------------------------------

def test_gspo_by_hand() -> None:
    # clip 0.2 / 0.2 for legible numbers; token log-ratios per sequence:
    #   0: [ln 2, 0]            s = exp(ln2 / 2) = sqrt 2, A = +1: clipped at 1.2 -> -1.2, no gradient
    #   1: [ln .9] * 3 (+ pad)  s = 0.9, A = +1: inside -> -0.9, d/dlp_t = -A s = -0.9
    #   2: [ln .5, ln .5]       s = 0.5, A = -1: max(0.5, 0.8) = 0.8 clipped low, no gradient
    lp, old, mask = _rows([[LN(2), 0.0], [LN(0.9)] * 3, [LN(0.5)] * 2])
    adv = torch.tensor([[1.0] * 3, [1.0] * 3, [-1.0] * 3])
    cfg = AlgorithmConfig(gspo_clip_low=0.2, gspo_clip_high=0.2)
    loss, met = gspo(lp, old, adv, mask, cfg)
    assert_close(loss, torch.tensor([[-1.2, -1.2, 0.0], [-0.9, -0.9, -0.9], [0.8, 0.8, 0.0]]))
    assert_close(met["ratio"], torch.tensor([[math.sqrt(2)] * 2 + [0.0], [0.9] * 3, [0.5, 0.5, 0.0]]))
    assert_close(met["pg_clipfrac"], torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 0]]))
    assert_close(met["pg_clipfrac_ratio_high"], torch.tensor([[1.0, 1, 0], [0, 0, 0], [0, 0, 0]]))
    assert_close(met["pg_clipfrac_ratio_low"], torch.tensor([[0.0, 0, 0], [0, 0, 0], [1, 1, 0]]))
    assert_close(met["ppo_kl"], torch.tensor([[-LN(2), 0.0, 0.0], [-LN(0.9)] * 3, [-LN(0.5)] * 2 + [0.0]]))
    assert "is_weight" not in met  # no behav_log_probs: no behaviour weight
    # seq-mean-token-mean over 3 sequences: sequence 1's tokens get -0.9 / 3 tokens / 3 sequences
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [-0.1, -0.1, -0.1], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_gspo_gradient_is_the_sequence_level_one(seed: int) -> None:
    """GSPO-token with one advantage per sequence, aggregated seq-mean-token-mean, has the value
    and the gradient of the paper's sequence objective -(1/B) sum_i min(s_i A_i, clip(s_i) A_i)
    with s_i = exp(mean_t(lp - old)), differentiated straight through s_i (no stop-gradient)."""
    d = _random(seed, b=16, spread=0.02)  # ratios near 1: some sequences clip, some do not
    cfg = AlgorithmConfig(gspo_clip_low=0.003, gspo_clip_high=0.004)
    loss, met = gspo(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], cfg)
    total = aggregate(loss, d["mask"], "seq-mean-token-mean")
    total.backward()
    lp_ref = d["log_probs"].detach().clone().requires_grad_(True)
    m = d["mask"].float()
    s = torch.exp(((lp_ref - d["old_log_probs"]) * m).sum(-1) / m.sum(-1))
    a = d["advantages"][:, 0]
    ref = -torch.minimum(s * a, s.clamp(1 - 0.003, 1 + 0.004) * a).mean()
    ref.backward()
    assert_close(total, ref.detach())
    assert_close(d["log_probs"].grad, lp_ref.grad * m)
    clipped = met["pg_clipfrac"].amax(-1)
    assert 0 < clipped.sum() < len(clipped)  # both cases are exercised


def _gspo_from_verls_math(old: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                          low: float, high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's gspo loss as its documentation states the math (written here, not copied): the
    token log-ratio log s_i,t = sg[mean_i(lp - old)] + lp_t - sg[lp_t], clamped above at 10;
    max(-A s, -A clip(s, 1 - low, 1 + high)); the mean over each sequence's tokens, then over
    sequences. pg_clipfrac and ppo_kl are token means over the batch."""
    mf = mask.to(lp.dtype)
    per_seq_tokens = mf.sum(-1).clamp(min=1)
    seq_mean_log_ratio = ((lp - old) * mf).sum(-1) / per_seq_tokens
    log_s = torch.clamp(seq_mean_log_ratio.detach()[:, None] + lp - lp.detach(), max=10.0)
    s = log_s.exp()
    plain, clipped = -adv * s, -adv * s.clamp(1 - low, 1 + high)
    token_loss = torch.max(plain, clipped)
    seqs_present = (mf.sum(-1) > 0).to(lp.dtype)
    loss = (((token_loss * mf).sum(-1) / per_seq_tokens) * seqs_present).sum() / seqs_present.sum()
    tokens = mf.sum()
    return loss, {"pg_clipfrac": float(((clipped > plain).to(lp.dtype) * mf).sum() / tokens),
                  "ppo_kl": float((-(lp.detach() - old) * mf).sum() / tokens)}


@pytest.mark.parametrize("seed", range(3))
def test_gspo_matches_verls_formula(seed: int) -> None:
    d = _random(seed, b=16, spread=0.05)
    cfg = AlgorithmConfig(gspo_clip_low=0.01, gspo_clip_high=0.015)
    loss, met = gspo(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], cfg)
    ours = aggregate(loss, d["mask"], "seq-mean-token-mean")
    ours.backward()
    lp_ref = d["log_probs"].detach().clone().requires_grad_(True)
    ref, ref_met = _gspo_from_verls_math(d["old_log_probs"], lp_ref, d["advantages"], d["mask"], 0.01, 0.015)
    ref.backward()
    assert_close(ours, ref.detach())
    assert_close(d["log_probs"].grad, lp_ref.grad * d["mask"])
    mf = d["mask"].float()
    for key, value in ref_met.items():
        assert float((met[key] * mf).sum() / mf.sum()) == pytest.approx(value, abs=1e-6), key
    assert 0 < ref_met["pg_clipfrac"] < 1


def test_gspo_behaviour_weight_is_per_sequence_and_capped() -> None:
    # ratio 1 (lp = old): the surrogate is -A per token; old - behav per token:
    #   sequence 0: [ln 3, ln 3] -> geometric mean 3 -> capped at is_cap 2
    #   sequence 1: [ln 2, ln 0.5, 0] -> mean 0 -> weight 1 (a per-token weight would be 2, 0.5, 1)
    lp, old, mask = _rows([[0.0, 0.0], [0.0, 0.0, 0.0]])
    behav = old - torch.tensor([[LN(3), LN(3), 0.0], [LN(2), LN(0.5), 0.0]])
    behav[0, 2] = float("nan")  # padding may hold anything
    adv = torch.ones(2, 3)
    loss, met = gspo(lp, old, adv, mask, AlgorithmConfig(), behav_log_probs=behav)
    assert_close(loss, torch.tensor([[-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]))
    assert_close(met["is_weight"], torch.tensor([[2.0, 2.0, 0.0], [1.0, 1.0, 1.0]]))
    assert_close(met["is_capfrac"], torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]))  # -A s_i w_i, s_i = 1


def test_gspo_with_behav_equal_old_is_gspo_without() -> None:
    d = _random(5)
    a, _ = gspo(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], AlgorithmConfig(),
                behav_log_probs=d["old_log_probs"].clone())
    b, _ = gspo(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], AlgorithmConfig())
    assert_close(a, b)


# ---- CISPO -----------------------------------------------------------------------------------

def test_cispo_by_hand() -> None:
    # bounds [1 - 0.2, 1 + 1.0] = [0.8, 2]; old = ln 0.5, ratios r = [0.5, 1.5, 5]:
    #   weights [0.8, 1.5, 2] (low bound, inside, high bound), A = [1, -1, 1]
    #   loss = -w A lp with lp = ln(0.5 r) = [ln .25, ln .75, ln 2.5]; d/dlp = -w A = [-0.8, 1.5, -2]
    lp, old, mask = _rows([[LN(0.5), LN(1.5), LN(5.0)]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, met = cispo(lp, old, adv, mask, AlgorithmConfig(cispo_clip_low=0.2, cispo_clip_high=1.0))
    assert_close(loss, torch.tensor([[-0.8 * LN(0.25), 1.5 * LN(0.75), -2.0 * LN(2.5)]]))
    assert_close(met["ratio"], torch.tensor([[0.5, 1.5, 5.0]]))
    assert_close(met["pg_clipfrac"], torch.tensor([[1.0, 0.0, 1.0]]))  # every clipped weight, any sign of A
    assert_close(met["pg_clipfrac_ratio_high"], torch.tensor([[0.0, 0.0, 1.0]]))
    assert_close(met["pg_clipfrac_ratio_low"], torch.tensor([[1.0, 0.0, 0.0]]))
    r = torch.tensor([[0.5, 1.5, 5.0]])
    assert_close(met["ppo_kl"], -r.log())
    assert_close(met["ppo_kl_k3"], r - 1 - r.log())
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[-0.8, 1.5, -2.0]]))  # no token's gradient is cut


def test_cispo_defaults_have_no_floor_and_a_ceiling_of_four() -> None:
    lp, old, mask = _rows([[LN(0.01), LN(3.0), LN(9.0)]])
    loss, met = cispo(lp, old, torch.ones(1, 3), mask, AlgorithmConfig())
    loss.sum().backward()
    assert_close(lp.grad, -torch.tensor([[0.01, 3.0, 4.0]]))
    assert_close(met["pg_clipfrac"], torch.tensor([[0.0, 0.0, 1.0]]))


def test_cispo_weighs_against_the_sampling_policy() -> None:
    # with behav_log_probs the ratio is exp(lp - behav), whatever old holds (no trust region)
    lp, old, mask = _rows([[0.0, 0.0, 0.0]])
    behav = lp.detach() - torch.log(torch.tensor([[0.5, 2.0, 6.0]]))
    adv = torch.ones(1, 3)
    loss, met = cispo(lp, old, adv, mask, AlgorithmConfig(), behav_log_probs=behav)
    assert_close(met["ratio"], torch.tensor([[0.5, 2.0, 6.0]]))
    assert_close(met["is_weight"], torch.tensor([[0.5, 2.0, 4.0]]))
    assert_close(met["is_capfrac"], torch.tensor([[0.0, 0.0, 1.0]]))
    assert_close(met["ppo_kl"], torch.zeros(1, 3))  # still against old
    loss.sum().backward()
    assert_close(lp.grad, -torch.tensor([[0.5, 2.0, 4.0]]))


def test_cispo_within_bounds_is_the_importance_weighted_reinforce_gradient() -> None:
    d = _random(3, spread=0.3)
    cfg = AlgorithmConfig(cispo_clip_high=100.0)  # no ratio reaches a bound
    loss, met = cispo(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], cfg)
    assert met["pg_clipfrac"].sum() == 0
    loss.sum().backward()
    r = torch.exp(d["log_probs"].detach() - d["old_log_probs"])
    assert_close(d["log_probs"].grad, torch.where(d["mask"], -r * d["advantages"], torch.zeros(())))


# ---- both ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", AGGREGATIONS.names())
@pytest.mark.parametrize("behav", [False, True])
@pytest.mark.parametrize("fn", [gspo, cispo])
def test_every_aggregation_mode_runs(fn, behav: bool, mode: str) -> None:
    d = _random(7)
    loss, _ = fn(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], AlgorithmConfig(),
                 behav_log_probs=d["behav"] if behav else None)
    total = aggregate(loss, d["mask"], mode, num_tokens=float(d["mask"].sum()) * 2, num_seqs=12.0)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(d["log_probs"].grad).all()
    assert (d["log_probs"].grad[~d["mask"]] == 0).all() and d["log_probs"].grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_through_the_actors_loss_in_async_mode(name: str) -> None:
    """policy_loss_fn with the behav_log_probs field: the loss's own capped weight reaches the
    rollout_corr/is_capped_frac figure, as decoupled_ppo's does."""
    d = _random(2, spread=1.0)
    algo = AlgorithmConfig(policy_loss=name, is_cap=1.1, cispo_clip_high=0.1)
    corr = RolloutCorr(algo)
    fields = {"advantages": d["advantages"], "behav_log_probs": d["behav"] - 1.0, "old_log_probs": d["old_log_probs"]}
    loss, metrics = policy_loss_fn(algo, corr)(d["log_probs"], None, d["mask"], fields,
                                               LossNorm(float(d["mask"].sum()), 6.0))
    loss.backward()
    assert torch.isfinite(loss) and {"actor/pg_clipfrac", "actor/ratio", "actor/is_weight"} <= metrics.keys()
    assert corr.metrics(*corr.totals())["rollout_corr/is_capped_frac"] > 0


@pytest.mark.parametrize("key,value", [("gspo_clip_low", 1.0), ("gspo_clip_low", -1e-4), ("gspo_clip_high", -1e-4),
                                       ("cispo_clip_low", 1.5), ("cispo_clip_low", -0.1),
                                       ("cispo_clip_high", -0.5), ("cispo_clip_high", float("nan"))])
@pytest.mark.parametrize("fn", [gspo, cispo])
def test_bad_bounds_are_refused_naming_the_key(fn, key: str, value: float) -> None:
    d = _random(0)
    with pytest.raises(ValueError, match=rf"algorithm\.{key}: must be"):
        fn(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], AlgorithmConfig(**{key: value}))


def test_config_loading_refuses_bad_bounds_and_a_second_rollout_weight() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.gspo_clip_low: must be in \[0, 1\), got 1.0"):
        load_config(None, ["algorithm.policy_loss=gspo", "algorithm.gspo_clip_low=1.0"])
    with pytest.raises(ConfigError, match=r"algorithm\.cispo_clip_high: must be >= 0, got -1.0"):
        load_config(None, ["algorithm.policy_loss=cispo", "algorithm.cispo_clip_high=-1"])
    for name in ("gspo", "cispo"):
        with pytest.raises(ConfigError, match=f"algorithm.rollout_is: 'geometric' with algorithm.policy_loss={name}"):
            load_config(None, [f"algorithm.policy_loss={name}", "algorithm.rollout_is=geometric"])
    cfg = load_config(None, ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"])
    assert (cfg.algorithm.gspo_clip_low, cfg.algorithm.gspo_clip_high) == (3e-4, 4e-4)
    assert dataclasses.asdict(cfg.algorithm)["cispo_clip_high"] == 3.0
