"""Policy losses: hand-computed values and the equivalences between variants."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import POLICY_LOSSES
from asyncflow.algorithms.policy_loss import decoupled_ppo, dual_clip, ppo_clip, tis
from asyncflow.config import AlgorithmConfig

CFG = AlgorithmConfig()
OLD = math.log(0.5)


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """log_probs (a leaf needing grad) and old_log_probs giving the wanted ratios."""
    old = torch.full((1, len(ratios)), OLD)
    return (old + torch.log(torch.tensor([ratios]))).requires_grad_(True), old


def _random(seed: int, b: int = 6, t: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 3
    return {
        "log_probs": (old + 0.5 * torch.randn(b, t, generator=gen)).requires_grad_(True),
        "old_log_probs": old,
        "advantages": torch.randn(b, t, generator=gen),
        "mask": torch.arange(t).unsqueeze(0) < torch.randint(1, t + 1, (b, 1), generator=gen),
        "behav": old + 0.3 * torch.randn(b, t, generator=gen),
    }


def test_ppo_clip_by_hand() -> None:
    # clip 0.2, loss = max(-A r, -A clip(r, 0.8, 1.2)):
    # r=1.5, A=+1: max(-1.5, -1.2) = -1.2  clipped (high)
    # r=0.5, A=+1: max(-0.5, -0.8) = -0.5  not clipped
    # r=1.1, A=-1: max( 1.1,  1.1) =  1.1  not clipped
    # r=0.7, A=-1: max( 0.7,  0.8) =  0.8  clipped (low)
    lp, old = _lp([1.5, 0.5, 1.1, 0.7])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, met = ppo_clip(lp, old, adv, torch.ones(1, 4), CFG)
    assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 0.8]]))
    assert_close(met["pg_clipfrac"], torch.tensor([[1.0, 0, 0, 1]]))
    assert_close(met["pg_clipfrac_ratio_high"], torch.tensor([[1.0, 0, 0, 0]]))
    assert_close(met["pg_clipfrac_ratio_low"], torch.tensor([[0.0, 0, 0, 1]]))
    assert_close(met["ratio"], torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
    r = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    assert_close(met["ppo_kl"], -r.log())  # verl's ppo_kl: k1, old_log_prob - log_prob
    assert_close(met["ppo_kl_k3"], r - 1 - r.log())  # k3 of the ratio, >= 0
    # gradient d(-A r)/d log p = -A r where unclipped, 0 where the clipped branch wins
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0]]))


def test_clip_higher_by_hand() -> None:
    # clip_high 0.28: r=1.25, A=+1 is inside [0.8, 1.28] -> -1.25 (ppo_clip would give -1.2)
    lp, old = _lp([1.25, 1.4])
    adv = torch.ones(1, 2)
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    loss, met = POLICY_LOSSES.get("clip_higher")(lp, old, adv, torch.ones(1, 2), cfg)
    assert_close(loss, torch.tensor([[-1.25, -1.28]]))
    assert_close(met["pg_clipfrac"], torch.tensor([[0.0, 1.0]]))
    base, _ = ppo_clip(lp, old, adv, torch.ones(1, 2), CFG)
    assert_close(base, torch.tensor([[-1.2, -1.2]]))


@pytest.mark.parametrize("seed", range(3))
def test_clip_higher_with_equal_clips_equals_ppo_clip(seed: int) -> None:
    d = _random(seed)
    cfg = AlgorithmConfig(clip_low=0.15, clip_high=0.15)
    a, ma = POLICY_LOSSES.get("clip_higher")(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], cfg)
    b, mb = ppo_clip(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], cfg)
    assert_close(a, b)
    assert ma.keys() == mb.keys()


def test_dual_clip_by_hand() -> None:
    # A = -1, c = 3: r=5 -> ppo loss max(5, 0.8) = 5, bounded to 3 (no gradient);
    # r=2 -> 2 < 3, unchanged; A = +1, r=5 -> ppo value -1.2, untouched.
    lp, old = _lp([5.0, 2.0, 5.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, met = dual_clip(lp, old, adv, torch.ones(1, 3), CFG)
    assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert_close(met["pg_clipfrac_lower"], torch.tensor([[1.0, 0.0, 0.0]]))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]]))


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_equals_ppo_clip_for_positive_advantages(seed: int) -> None:
    d = _random(seed)
    d["log_probs"] = (d["old_log_probs"] + 3 * torch.randn(6, 5)).requires_grad_(True)  # many far-off ratios
    adv = d["advantages"].abs()
    a, _ = dual_clip(d["log_probs"], d["old_log_probs"], adv, d["mask"], CFG)
    b, _ = ppo_clip(d["log_probs"], d["old_log_probs"], adv, d["mask"], CFG)
    assert_close(a, b)


def test_decoupled_ppo_and_tis_by_hand() -> None:
    # ppo part: r = 1 everywhere, A = [1, 1, -1] -> [-1, -1, 1]
    # weight exp(old - behav): [3 -> capped at is_cap 2, 1.5, 0.5]
    lp, old = _lp([1.0, 1.0, 1.0])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    behav = old - torch.log(torch.tensor([[3.0, 1.5, 0.5]]))
    m = torch.ones(1, 3)
    loss, met = decoupled_ppo(lp, old, adv, m, CFG, behav_log_probs=behav)
    assert_close(loss, torch.tensor([[-2.0, -1.5, 0.5]]))
    assert_close(met["is_weight"], torch.tensor([[2.0, 1.5, 0.5]]))
    assert_close(met["is_capfrac"], torch.tensor([[1.0, 0.0, 0.0]]))
    # tis has its own cap: tis_cap 1.2 -> weights [1.2, 1.2, 0.5]
    loss, met = tis(lp, old, adv, m, AlgorithmConfig(tis_cap=1.2), behav_log_probs=behav)
    assert_close(loss, torch.tensor([[-1.2, -1.2, 0.5]]))
    assert_close(met["is_capfrac"], torch.tensor([[1.0, 1.0, 0.0]]))


@pytest.mark.parametrize("name", ["decoupled_ppo", "tis"])
@pytest.mark.parametrize("seed", range(3))
def test_importance_weighted_with_behav_equal_old_is_ppo_clip(name: str, seed: int) -> None:
    d = _random(seed)
    a, _ = POLICY_LOSSES.get(name)(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], CFG,
                                   behav_log_probs=d["old_log_probs"].clone())
    b, _ = ppo_clip(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], CFG)
    assert_close(a, b)


@pytest.mark.parametrize("name", ["decoupled_ppo", "tis"])
def test_importance_weighted_needs_behav(name: str) -> None:
    d = _random(0)
    with pytest.raises(ValueError, match=f"{name} needs behav_log_probs"):
        POLICY_LOSSES.get(name)(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], CFG)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_gradients_flow_into_log_probs_only(name: str) -> None:
    d = _random(1)
    old = d["old_log_probs"].clone().requires_grad_(True)
    adv = d["advantages"].clone().requires_grad_(True)
    behav = d["behav"].clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(d["log_probs"], old, adv, d["mask"], CFG, behav_log_probs=behav)
    loss.sum().backward()
    assert d["log_probs"].grad is not None and d["log_probs"].grad.abs().sum() > 0
    assert old.grad is None and adv.grad is None and behav.grad is None
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_mask_zeros_never_contribute(name: str) -> None:
    d = _random(2)
    pad = ~d["mask"]
    assert pad.any()
    lp = d["log_probs"].detach().clone()
    lp[pad] = float("-inf")
    lp.requires_grad_(True)
    old, adv, behav = d["old_log_probs"].clone(), d["advantages"].clone(), d["behav"].clone()
    old[pad], adv[pad], behav[pad] = float("nan"), float("inf"), float("-inf")
    loss, metrics = POLICY_LOSSES.get(name)(lp, old, adv, d["mask"].float(), CFG, behav_log_probs=behav)
    assert (loss[pad] == 0).all() and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[pad] == 0).all()
    for key, v in metrics.items():
        assert v.shape == loss.shape and (v[pad] == 0).all() and torch.isfinite(v).all(), key
    # and the real tokens are unaffected by what padding holds
    ref, _ = POLICY_LOSSES.get(name)(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], CFG,
                                     behav_log_probs=d["behav"])
    assert_close(loss[~pad], ref[~pad])


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_common_diagnostics_and_extreme_ratios_stay_finite(name: str) -> None:
    lp = torch.tensor([[0.0, -200.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    loss, met = POLICY_LOSSES.get(name)(lp, old, adv, torch.ones(1, 3), CFG, behav_log_probs=old.clone())
    assert {"pg_clipfrac", "ppo_kl", "ppo_kl_k3", "ratio"} <= met.keys()
    assert torch.isfinite(loss).all() and all(torch.isfinite(v).all() for v in met.values())
    assert (met["ppo_kl_k3"] >= 0).all()
    # log-ratios clamped at max_log_ratio (20, as verl) before exp and in ppo_kl
    assert_close(met["ppo_kl"], torch.tensor([[-20.0, 20.0, 0.0]]))


def test_errors_name_the_problem() -> None:
    d = _random(0)
    with pytest.raises(ValueError, match=r"advantages has shape \(6, 4\) but log_probs has shape \(6, 5\)"):
        ppo_clip(d["log_probs"], d["old_log_probs"], d["advantages"][:, :4], d["mask"], CFG)
    with pytest.raises(ValueError, match=r"behav_log_probs has shape \(1, 5\)"):
        tis(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"], CFG, behav_log_probs=torch.zeros(1, 5))
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; registered: cispo, clip_higher, decoupled_ppo"):
        POLICY_LOSSES.get("grpo")


@pytest.mark.parametrize("kwargs", [{"clip_low": 1.0}, {"clip_low": -0.1}, {"clip_high": -0.1},
                                    {"dual_clip_c": 1.0}, {"is_cap": 0.0}, {"tis_cap": -1.0},
                                    {"max_log_ratio": 0.0}, {"clip_high": float("nan")}])
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_config_validation_names_the_key(kwargs: dict, name: str) -> None:
    (key, _), = kwargs.items()
    d = _random(0)
    with pytest.raises(ValueError, match=rf"algorithm\.{key}: must be"):
        POLICY_LOSSES.get(name)(d["log_probs"], d["old_log_probs"], d["advantages"], d["mask"],
                                AlgorithmConfig(**kwargs), behav_log_probs=d["behav"])


def test_vanilla_is_verls_name_for_dual_clip() -> None:
    assert POLICY_LOSSES.get("vanilla") is dual_clip


def _verl_vanilla(old: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor,
                  clip: float = 0.2, c: float = 3.0) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's compute_policy_loss_vanilla per token, with its three metrics (masked means)."""
    mf = m.to(lp.dtype)

    def mean(x: torch.Tensor) -> float:
        return float((x * mf).sum() / mf.sum())
    neg_kl = (lp - old).clamp(-20.0, 20.0)
    ratio = neg_kl.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - clip, 1 + clip)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * c
    clip2 = torch.minimum(pg3, clip1)
    loss = torch.where(adv < 0, clip2, clip1)
    return loss, {"pg_clipfrac": mean((pg2 > pg1).to(lp.dtype)), "ppo_kl": mean(-neg_kl),
                  "pg_clipfrac_lower": mean(((clip1 > pg3) & (adv < 0)).to(lp.dtype))}


@pytest.mark.parametrize("seed", range(3))
def test_vanilla_matches_verl_loss_and_metrics(seed: int) -> None:
    d = _random(seed)
    d["log_probs"] = (d["old_log_probs"] + 1.5 * torch.randn(6, 5, generator=torch.Generator().manual_seed(seed)))
    m = d["mask"]
    loss, met = POLICY_LOSSES.get("vanilla")(d["log_probs"], d["old_log_probs"], d["advantages"], m, CFG)
    ref_loss, ref_met = _verl_vanilla(d["old_log_probs"], d["log_probs"], d["advantages"], m)
    assert_close(loss[m], ref_loss[m])
    mf = m.float()
    for key, value in ref_met.items():
        assert float((met[key] * mf).sum() / mf.sum()) == pytest.approx(value, abs=1e-6), key
    assert ref_met["pg_clipfrac"] > 0 and ref_met["pg_clipfrac_lower"] > 0  # the cases are exercised
