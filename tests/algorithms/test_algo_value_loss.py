"""Value losses: hand-computed values, clipping, gradients and padding."""
from __future__ import annotations

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import VALUE_LOSSES, clipped_value_loss, mse_value_loss

# clip 0.2, old = 1 everywhere:
# t0: V=1.5 -> V_clip=1.2, R=1: (0.5)^2=0.25 vs (0.2)^2=0.04 -> 0.5*0.25 = 0.125, not clipped
# t1: V=1.0 -> V_clip=1.0, R=2: 1 vs 1                       -> 0.5,              not clipped
# t2: V=0.6 -> V_clip=0.8, R=0: 0.36 vs 0.64                 -> 0.5*0.64 = 0.32,  clipped
V = [[1.5, 1.0, 0.6]]
OLD = torch.tensor([[1.0, 1.0, 1.0]])
RET = torch.tensor([[1.0, 2.0, 0.0]])
M = torch.ones(1, 3)


def test_clipped_by_hand() -> None:
    v = torch.tensor(V, requires_grad=True)
    loss, met = clipped_value_loss(v, OLD, RET, M, clip=0.2)
    assert_close(loss, torch.tensor([[0.125, 0.5, 0.32]]))
    assert_close(met["vf_clipfrac"], torch.tensor([[0.0, 0.0, 1.0]]))
    loss.sum().backward()
    # d/dV 0.5 (V - R)^2 = V - R on unclipped tokens; 0 where the clipped branch wins
    assert_close(v.grad, torch.tensor([[0.5, -1.0, 0.0]]))


def test_mse_by_hand_and_clipped_with_infinite_clip_equals_mse() -> None:
    v = torch.tensor(V)
    loss, met = mse_value_loss(v, OLD, RET, M)
    assert_close(loss, torch.tensor([[0.125, 0.5, 0.18]]))  # 0.5 * [0.25, 1, 0.36]
    assert (met["vf_clipfrac"] == 0).all()
    inf_clip, _ = clipped_value_loss(v, OLD, RET, M, clip=float("inf"))
    assert_close(inf_clip, loss)


@pytest.mark.parametrize("name", ["clipped", "mse"])
def test_gradients_into_values_only_and_padding_ignored(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, generator=gen)
    old = (v + 0.3 * torch.randn(3, 4, generator=gen)).requires_grad_(True)
    ret = torch.randn(3, 4, generator=gen).requires_grad_(True)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]).bool()
    v_pad = v.clone()
    v_pad[~m] = float("nan")
    v_pad.requires_grad_(True)
    loss, met = VALUE_LOSSES.get(name)(v_pad, old, ret, m, clip=0.2)
    assert (loss[~m] == 0).all() and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(v_pad.grad).all() and (v_pad.grad[~m] == 0).all()
    assert old.grad is None and ret.grad is None
    assert not met["vf_clipfrac"].requires_grad and (met["vf_clipfrac"][~m] == 0).all()
    ref, _ = VALUE_LOSSES.get(name)(v, old, ret, m, clip=0.2)
    assert_close(loss[m], ref[m])


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"returns has shape \(1, 2\) but values has shape \(1, 3\)"):
        clipped_value_loss(torch.tensor(V), OLD, RET[:, :2], M)
    with pytest.raises(ValueError, match="clip must be a number >= 0"):
        clipped_value_loss(torch.tensor(V), OLD, RET, M, clip=-0.1)
    with pytest.raises(ValueError, match="unknown value loss 'huber'; registered: clipped, mse"):
        VALUE_LOSSES.get("huber")
