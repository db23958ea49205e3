"""KL estimators and the reward-folding variant."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import K3_MAX, KL_ESTIMATORS, kl_penalty_to_reward
from asyncflow.algorithms.kl import k1, k2, k3


def test_by_hand() -> None:
    # p = 0.5, q = 0.25: log p - log q = log 2 = 0.693147
    # k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227; k3 = q/p - log(q/p) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    assert k1(lp, ref).item() == pytest.approx(0.693147, abs=1e-6)
    assert k2(lp, ref).item() == pytest.approx(0.240227, abs=1e-6)
    assert k3(lp, ref).item() == pytest.approx(0.193147, abs=1e-6)
    # equal distributions: all zero
    for name in KL_ESTIMATORS.names():
        assert KL_ESTIMATORS.get(name)(lp, lp.clone()).item() == 0.0


def test_k1_and_k3_are_unbiased_for_kl_under_exact_expectation() -> None:
    # E_{v~p}[k(v)] summed exactly over a small vocabulary equals KL(p || q) for k1 and k3.
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(1, 6, generator=gen, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(1, 6, generator=gen, dtype=torch.float64), -1)
    kl = (logp.exp() * (logp - logq)).sum()
    for est in (k1, k3):
        assert (logp.exp() * est(logp, logq)).sum().item() == pytest.approx(kl.item(), rel=1e-9)


def test_k3_is_nonnegative_and_clamped() -> None:
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(50, 20, generator=gen) * 5
    ref = torch.randn(50, 20, generator=gen) * 5
    out = k3(lp, ref)
    assert (out >= 0).all() and (out <= K3_MAX).all()
    extreme = k3(torch.tensor([[0.0, -1000.0]]), torch.tensor([[-1000.0, 0.0]]))
    assert torch.isfinite(extreme).all() and (extreme == K3_MAX).all()


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_mask_and_gradients(name: str) -> None:
    lp = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, float("-inf")]], requires_grad=True)
    m = torch.tensor([[1, 1, 0]])
    out = KL_ESTIMATORS.get(name)(lp, ref, m)
    assert out[0, 2] == 0 and torch.isfinite(out).all()
    out.sum().backward()
    assert ref.grad is None  # the reference is a constant
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0 and (lp.grad[0, :2] != 0).all()


def test_gradients_by_hand() -> None:
    # d = log p - log q = 0.5: dk1/dlogp = 1, dk2/dlogp = d = 0.5, dk3/dlogp = 1 - exp(-d) = 0.393469
    for est, g in ((k1, 1.0), (k2, 0.5), (k3, 1 - math.exp(-0.5))):
        lp = torch.tensor([[0.0]], requires_grad=True)
        est(lp, torch.tensor([[-0.5]])).sum().backward()
        assert lp.grad.item() == pytest.approx(g, abs=1e-6)


def test_kl_penalty_to_reward_by_hand() -> None:
    # k1 = [0.1, 0.2, 0.3, pad]; coef 0.1 -> rewards [0, 0, 1] - [0.01, 0.02, 0.03] = [-0.01, -0.02, 0.97], pad 0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    lp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.1, -1.2, -1.3, -9.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    out = kl_penalty_to_reward(rewards, lp, ref, m, coef=0.1, estimator="k1")
    assert_close(out, torch.tensor([[-0.01, -0.02, 0.97, 0.0]]))
    assert not out.requires_grad
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; registered: k1, k2, k3"):
        kl_penalty_to_reward(rewards, lp, ref, m, coef=0.1, estimator="k4")
    with pytest.raises(ValueError, match="coef must be >= 0"):
        kl_penalty_to_reward(rewards, lp, ref, m, coef=-1.0)


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"ref_log_probs has shape \(2, 2\) but log_probs has shape \(2, 3\)"):
        k3(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but log_probs has shape \(2, 3\)"):
        k1(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
