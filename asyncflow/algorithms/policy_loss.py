"""Policy-gradient losses: per-token loss [B, T] (unaggregated) plus per-token diagnostics.

Uniform signature, so a recipe can name one (``POLICY_LOSSES``)::

    fn(log_probs, old_log_probs, advantages, mask, cfg, *, behav_log_probs=None)
        -> (loss [B, T], {"clipfrac", "ratio", "approx_kl", ...: [B, T]})

Gradients flow into ``log_probs`` only (everything else is detached). Loss and diagnostics are
0 where ``mask`` is 0, whatever the padding holds; aggregate both with ``aggregate(..., mask)``.
Diagnostics are detached: 0/1 indicator tensors for the "...frac" entries, values otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_same_shape
from .registry import POLICY_LOSSES


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the policy losses.

    clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high]. Equal for PPO;
        DAPO's clip-higher raises clip_high (e.g. 0.28) so low-probability tokens can grow.
    dual_clip_c: dual-clip bound; for A < 0 the loss is capped at dual_clip_c * -A (> 1).
    is_cap: cap on the behaviour importance weight of ``decoupled_ppo``.
    tis_cap: cap on the truncated importance weight of ``tis``.
    max_log_ratio: log-ratios are clamped to +-this before exp, so a stale or broken token
        gives a large finite ratio rather than inf/NaN (such tokens are clipped anyway).
    """
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 3.0
    is_cap: float = 2.0
    tis_cap: float = 2.0
    max_log_ratio: float = 20.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"PolicyLossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"PolicyLossConfig.clip_high must be >= 0, got {self.clip_high}")
        if not self.dual_clip_c > 1.0:
            raise ValueError(f"PolicyLossConfig.dual_clip_c must be > 1, got {self.dual_clip_c}")
        for name in ("is_cap", "tis_cap", "max_log_ratio"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"PolicyLossConfig.{name} must be > 0, got {getattr(self, name)}")


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _prepare(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
             behav_log_probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Validated bool mask, and detached old log-probs and advantages zeroed at padding."""
    check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     mask=mask, behav_log_probs=behav_log_probs)
    m = as_bool_mask(mask, log_probs, like_name="log_probs")
    z = _zero(log_probs)
    # where() before any arithmetic: padding may hold -inf/NaN, which must not reach exp or grads.
    old = torch.where(m, old_log_probs.detach().to(log_probs.dtype), z)
    adv = torch.where(m, advantages.detach().to(log_probs.dtype), z)
    return m, old, adv


def _clipped_surrogate(log_probs: Tensor, old: Tensor, adv: Tensor, m: Tensor,
                       cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate max(-A r, -A clip(r, 1-cl, 1+ch)) with r = exp(log_probs - old)."""
    z = _zero(log_probs)
    log_ratio = torch.where(m, log_probs, z) - old
    log_ratio = log_ratio.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        active = (clipped > unclipped) & m  # the clipped branch wins: this token's gradient is cut
        r = ratio.detach()
        metrics = {
            "clipfrac": active.to(log_probs.dtype),
            "clipfrac_high": (active & (adv > 0)).to(log_probs.dtype),  # r > 1 + clip_high
            "clipfrac_low": (active & (adv < 0)).to(log_probs.dtype),  # r < 1 - clip_low
            "ratio": torch.where(m, r, z),
            # k3 estimate of KL(old || new) from samples of old: (r - 1) - log r >= 0.
            "approx_kl": torch.where(m, (r - 1.0) - log_ratio.detach(), z),
        }
    return torch.where(m, loss, z), metrics


@POLICY_LOSSES.register("ppo_clip")
@POLICY_LOSSES.register("clip_higher")
def ppo_clip(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
             cfg: PolicyLossConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Standard PPO clipped surrogate. Registered also as ``clip_higher`` (DAPO): the same
    function, asymmetric through ``cfg.clip_high > cfg.clip_low``. ``behav_log_probs`` is ignored."""
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs)
    return _clipped_surrogate(log_probs, old, adv, m, cfg)


@POLICY_LOSSES.register("dual_clip")
def dual_clip(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
              cfg: PolicyLossConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: for A < 0 the PPO loss grows without bound in the ratio; cap it at
    ``dual_clip_c * -A`` so one very off-policy token cannot dominate. Same as ppo_clip for A >= 0."""
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs)
    loss, metrics = _clipped_surrogate(log_probs, old, adv, m, cfg)
    bound = -adv * cfg.dual_clip_c
    neg = adv < 0
    out = torch.where(neg, torch.minimum(loss, bound), loss)
    with torch.no_grad():
        metrics["dual_clipfrac"] = (neg & (loss > bound) & m).to(log_probs.dtype)
    return out, metrics


def _importance_weighted(name: str, cap: float, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                         mask: Tensor, cfg: PolicyLossConfig,
                         behav_log_probs: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """min(exp(old - behav), cap) (detached) times the PPO-clip surrogate relative to ``old``."""
    if behav_log_probs is None:
        raise ValueError(f"{name} needs behav_log_probs (the rollout engine's log-probs of the sampled "
                         f"tokens); old_log_probs must be the trainer's recomputed log-probs")
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs)
    loss, metrics = _clipped_surrogate(log_probs, old, adv, m, cfg)
    z = _zero(log_probs)
    with torch.no_grad():
        behav = torch.where(m, behav_log_probs.detach().to(log_probs.dtype), z)
        raw = torch.exp((old - behav).clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
        weight = torch.where(m, raw.clamp(max=cap), z)
        metrics["is_weight"] = weight
        metrics["is_capfrac"] = ((raw > cap) & m).to(log_probs.dtype)
    return loss * weight, metrics


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                  cfg: PolicyLossConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL-style) for asynchronous, off-policy rollouts.

    ``old_log_probs`` are the *proximal* policy's log-probs (recomputed by the trainer), the
    trust region is taken around them; ``behav_log_probs`` are the stale rollout policy's.
    The off-policyness is corrected by w = exp(old - behav), detached and *capped* at
    ``cfg.is_cap`` (capped rather than masked out: the token still teaches, with bounded
    variance). With behav == old the weight is 1 and this is ppo_clip.
    """
    return _importance_weighted("decoupled_ppo", cfg.is_cap, log_probs, old_log_probs, advantages,
                                mask, cfg, behav_log_probs)


@POLICY_LOSSES.register("tis")
def tis(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
        cfg: PolicyLossConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with truncated importance sampling, for the rollout-vs-trainer numerical
    mismatch (e.g. vLLM vs FSDP kernels): the surrogate times min(exp(old - behav), tis_cap),
    detached. Same formula as decoupled_ppo with its own cap; the intent differs (numerics,
    not staleness)."""
    return _importance_weighted("tis", cfg.tis_cap, log_probs, old_log_probs, advantages,
                                mask, cfg, behav_log_probs)
