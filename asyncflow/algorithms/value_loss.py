"""Critic losses: per-token loss [B, T] (unaggregated) plus per-token diagnostics.

Uniform signature (``VALUE_LOSSES``)::

    fn(values, old_values, returns, mask, *, clip=0.2) -> (loss [B, T], {"vf_clipfrac": [B, T]})

Gradients flow into ``values`` only; loss and diagnostics are 0 where ``mask`` is 0.
Both losses carry the factor 0.5, so ``clipped`` with an infinite clip equals ``mse``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_same_shape
from .registry import VALUE_LOSSES


def _prepare(values: Tensor, old_values: Tensor, returns: Tensor,
             mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = as_bool_mask(mask, values, like_name="values")
    z = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, z)
    old = torch.where(m, old_values.detach().to(values.dtype), z)
    ret = torch.where(m, returns.detach().to(values.dtype), z)
    return m, v, old, ret


@VALUE_LOSSES.register("clipped")
def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       clip: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value clipping: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clamp(V - old, +-clip).

    Keeps the critic near the values used to compute the advantages; the max makes it a
    pessimistic bound (clipping can only remove gradient, never add a better-looking loss).
    """
    if not (isinstance(clip, (int, float)) and clip >= 0 and not math.isnan(clip)):
        raise ValueError(f"clip must be a number >= 0, got {clip!r}")
    m, v, old, ret = _prepare(values, old_values, returns, mask)
    v_clipped = old + (v - old).clamp(-clip, clip)
    err = (v - ret) ** 2
    err_clipped = (v_clipped - ret) ** 2
    loss = 0.5 * torch.maximum(err, err_clipped)
    z = torch.zeros((), dtype=values.dtype, device=values.device)
    with torch.no_grad():
        metrics = {"vf_clipfrac": ((err_clipped > err) & m).to(values.dtype)}
    return torch.where(m, loss, z), metrics


@VALUE_LOSSES.register("mse")
def mse_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                   clip: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * (V - R)^2; ``old_values`` and ``clip`` are accepted for a uniform signature and ignored."""
    m, v, _, ret = _prepare(values, old_values, returns, mask)
    z = torch.zeros((), dtype=values.dtype, device=values.device)
    loss = torch.where(m, 0.5 * (v - ret) ** 2, z)
    return loss, {"vf_clipfrac": torch.zeros_like(loss).detach()}
