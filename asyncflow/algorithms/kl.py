"""Per-token KL estimators between the current policy p and a reference q, from the
log-probs of the sampled tokens (the samples come from p, or a policy close to it).

Uniform signature (``KL_ESTIMATORS``): ``fn(log_probs, ref_log_probs, mask=None) -> [B, T]``,
0 where ``mask`` is 0. Used either as a loss term (aggregate it with the mask) or folded into
the reward (``kl_penalty_to_reward``).

* k1 = log p - log q: unbiased for KL(p||q) but high variance and can be negative.
* k2 = 0.5 (log p - log q)^2: low variance, biased; its gradient is that of a KL penalty.
* k3 = exp(log q - log p) - (log q - log p) - 1: unbiased, always >= 0, low variance.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_same_shape
from .registry import KL_ESTIMATORS

# k3 explodes as exp(log q - log p): the log-ratio is clamped before exp and k3 clamped after,
# so a token the reference finds absurd contributes a bounded penalty (and no gradient).
K3_MAX_LOG_RATIO = 20.0
K3_MAX = 10.0


def _diff(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """log p - log q (ref detached), 0 at padding."""
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask)
    ref = ref_log_probs.detach().to(log_probs.dtype)
    if mask is None:
        return log_probs - ref, None
    m = as_bool_mask(mask, log_probs, like_name="log_probs")
    z = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return torch.where(m, log_probs, z) - torch.where(m, ref, z), m


def _masked(x: Tensor, m: Tensor | None) -> Tensor:
    return x if m is None else torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


@KL_ESTIMATORS.register("k1")
def k1(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor | None = None) -> Tensor:
    """log p - log q."""
    d, m = _diff(log_probs, ref_log_probs, mask)
    return _masked(d, m)


@KL_ESTIMATORS.register("k2")
def k2(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor | None = None) -> Tensor:
    """0.5 * (log p - log q)^2."""
    d, m = _diff(log_probs, ref_log_probs, mask)
    return _masked(0.5 * d * d, m)


@KL_ESTIMATORS.register("k3")
def k3(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor | None = None) -> Tensor:
    """exp(log q - log p) - (log q - log p) - 1, clamped to [0, K3_MAX]."""
    d, m = _diff(log_probs, ref_log_probs, mask)
    x = (-d).clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
    return _masked((torch.exp(x) - x - 1.0).clamp(0.0, K3_MAX), m)


@torch.no_grad()
def kl_penalty_to_reward(token_rewards: Tensor, log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor,
                         coef: float, estimator: str = "k1") -> Tensor:
    """token_rewards - coef * KL per token (classic RLHF reward shaping), 0 at padding, no grad.

    The KL is then optimised through the advantage rather than as a loss term.
    """
    check_same_shape(token_rewards=token_rewards, log_probs=log_probs)
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef!r}")
    kl = KL_ESTIMATORS.get(estimator)(log_probs.detach(), ref_log_probs, mask)
    m = as_bool_mask(mask, token_rewards, like_name="token_rewards")
    z = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    return torch.where(m, token_rewards - coef * kl.to(token_rewards.dtype), z)
