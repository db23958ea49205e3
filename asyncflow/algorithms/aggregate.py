"""Masked reductions and the loss aggregation modes (per-token loss [B, T] -> scalar).

Why the ``num_tokens`` / ``num_seqs`` arguments: the engine splits a global batch into
data-parallel shards and micro-batches and accumulates gradients. If each micro-batch divided
by its *own* token count, the sum over micro-batches would weight tokens unevenly (a token in
a short micro-batch would count more). Passing the *global* counts (``count_tokens`` /
``count_seqs`` summed over the whole global batch) makes each micro-batch's value its exact
share, so summing them over micro-batches and ranks gives the full-batch loss. Note that this
is a *sum* across DP ranks: an engine whose gradient all-reduce averages must multiply the
micro-batch loss by the DP world size.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_2d
from .registry import AGGREGATIONS


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set; padding (even NaN/inf) never contributes."""
    m = as_bool_mask(mask, values)
    v = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked entries; 0 where there are none (instead of NaN)."""
    m = as_bool_mask(mask, values)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / count.clamp_min(1).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = False) -> Tensor:
    """Variance over all masked entries (population variance unless ``unbiased``)."""
    m = as_bool_mask(mask, values)
    mean = masked_mean(values, m)
    count = m.sum()
    denom = (count - 1 if unbiased else count).clamp_min(1).to(values.dtype)
    return masked_sum((values - mean) ** 2, m) / denom


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-6,
                  unbiased: bool = False) -> Tensor:
    """(values - mean) / (std + eps) over all masked entries, 0 at padding.

    The std is the population std (divide by n: the whitened valid entries have unit RMS)
    unless ``unbiased`` (divide by n - 1, as verl's masked_whiten). Deviations are taken from
    the first valid entry before averaging, so equal valid entries whiten to exactly 0.
    With ``shift_mean=False`` only the scale changes (the mean is added back), which keeps
    the sign of e.g. an all-positive advantage batch.
    """
    m = as_bool_mask(mask, values)
    z = torch.zeros((), dtype=values.dtype, device=values.device)
    first = m.reshape(-1).to(torch.uint8).argmax()  # the first valid entry (index 0 if none): no host sync
    shifted = torch.where(m, values - values.reshape(-1)[first], z)
    mean = masked_mean(shifted, m)
    std = masked_var(shifted, m, unbiased=unbiased).sqrt()
    out = (shifted - mean) / (std + eps)
    if not shift_mean:
        out = out + mean + values.reshape(-1)[first]
    return torch.where(m, out, z)


def count_tokens(mask: Tensor) -> int:
    """Number of real tokens; sum this over the global batch to get ``num_tokens``."""
    return int((mask != 0).sum().item())


def count_seqs(mask: Tensor) -> int:
    """Number of sequences with at least one real token (all-padding rows do not count);
    sum this over the global batch to get ``num_seqs``."""
    check_2d("mask", mask)
    return int((mask != 0).any(dim=-1).sum().item())


def _divisor(given: float | Tensor | None, local: Tensor, what: str, dtype: torch.dtype) -> Tensor | float:
    if given is None:
        return local.clamp_min(1).to(dtype)
    if isinstance(given, Tensor):
        return given.to(dtype)
    if not given >= 0:
        raise ValueError(f"{what} must be >= 0 (the global count over the whole batch), got {given!r}")
    # 0 means the whole global batch is empty, so this piece is too: its sum is 0, keep it 0.
    return max(float(given), 1.0)


@AGGREGATIONS.register("token-mean")
def token_mean(per_token: Tensor, mask: Tensor, *, num_tokens: float | Tensor | None = None,
               num_seqs: float | Tensor | None = None) -> Tensor:
    """Every real token weighs the same: sum / num_tokens (long answers dominate)."""
    m = as_bool_mask(mask, per_token, like_name="per_token")
    return masked_sum(per_token, m) / _divisor(num_tokens, m.sum(), "num_tokens", per_token.dtype)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(per_token: Tensor, mask: Tensor, *, num_tokens: float | Tensor | None = None,
                       num_seqs: float | Tensor | None = None) -> Tensor:
    """Sum of per-sequence token sums / num_seqs (Dr. GRPO style, no length normalisation)."""
    m = as_bool_mask(mask, per_token, like_name="per_token")
    check_2d("per_token", per_token)
    local = m.any(dim=-1).sum()
    return masked_sum(per_token, m) / _divisor(num_seqs, local, "num_seqs", per_token.dtype)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(per_token: Tensor, mask: Tensor, *, num_tokens: float | Tensor | None = None,
                        num_seqs: float | Tensor | None = None) -> Tensor:
    """Sum of per-sequence token means / num_seqs (original GRPO: every sequence weighs the same)."""
    m = as_bool_mask(mask, per_token, like_name="per_token")
    check_2d("per_token", per_token)
    seq_means = masked_mean(per_token, m, dim=-1)  # 0 for all-padding rows
    local = m.any(dim=-1).sum()
    return seq_means.sum() / _divisor(num_seqs, local, "num_seqs", per_token.dtype)


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token-mean", *,
              num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None) -> Tensor:
    """Reduce a per-token [B, T] loss to a scalar with the aggregation named ``mode``.

    Leave ``num_tokens``/``num_seqs`` None for a plain mean over this batch; pass global
    counts (see the module docstring) when this batch is one micro-batch of a larger one.
    A count of 0 (an empty global batch) gives 0; a negative count raises.
    """
    check_2d("per_token", per_token)
    return AGGREGATIONS.get(mode)(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs)
