"""Rollout correction: the training-inference mismatch, measured and corrected.

The rollout engine (vLLM, or the built-in one) reports the log-prob of every token it sampled:
the *behaviour* log-probs. The trainer recomputes them with its own kernels: the *proximal*
(old) log-probs, the anchor of the PPO ratio. Even on the same weights the two differ (other
kernels, precision, batch shapes), and in async mode the behaviour weights may also be older.
Per token, rho = exp(proximal - behaviour) = pi_old / pi_behav is the importance ratio that
turns an expectation under the behaviour policy into one under the proximal policy.

Pure functions on padded [B, T] tensors with a ``mask`` (bool or 0/1) of real tokens; nothing
here needs gradients (every output is detached). Padding may hold anything (-inf, NaN): it is
replaced before any arithmetic and never reaches a result.

Levels (``algorithm.rollout_is`` / ``algorithm.rollout_mask``; "" = off):

* ``token``: each token's own rho;
* ``sequence``: the sequence's product of ratios, exp(sum of log rho over its tokens), given to
  every token of the sequence;
* ``geometric``: the geometric mean of the sequence's ratios, exp(mean of log rho), likewise
  (length-normalised: a long sequence's product drifts far from 1 even if every token is close);
* ``any_token`` (masks only): the whole sequence is dropped when any one of its tokens' rho leaves
  the band.

Every log-ratio (a token's, a sequence's sum or mean) is clamped to +-``max_log_ratio`` before
``exp``, as the policy losses do.

How they compose with the policy losses (``algorithm.policy_loss``):

* the importance weight w = min(rho_level, ``rollout_is_cap``) multiplies the policy loss's
  per-token loss (ppo_clip, dual_clip: their PPO ratio is taken against the proximal log-probs,
  so w moves the expectation from the behaviour policy to the proximal one). With
  ``rollout_is=token``, ppo_clip times w is exactly decoupled_ppo / tis with that cap; the two
  losses already apply their own token weight, so ``rollout_is`` with them is refused (a token
  would be weighted twice by the same ratio). ``policy_loss=auto`` resolves to ppo_clip when
  ``rollout_is`` is set.
* the mask (any level, any loss, with or without a weight) drops the tokens whose ratio leaves
  [``rollout_mask_low``, ``rollout_mask_high``]: they leave the loss AND every normalisation of
  ``algorithm.loss_agg``, as if they were padding (the actor turns the mask into the engine's
  per-token loss mask: the global token count, the count of sequences with a kept token and
  each sequence's own token count are all of kept tokens). A dropped token's gradient is 0.
  Weights and masks are both computed from the ratios of all of a sequence's tokens, before
  any is dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..algorithm_config import AlgorithmConfig
from ._checks import ROLLOUT_CORR_KEYS, as_bool_mask, check_2d, check_algorithm_config, check_same_shape


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _masked_pair(old_log_probs: Tensor, behav_log_probs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The validated bool mask, a zero, and both log-probs detached with padding zeroed (padding
    may hold -inf or NaN, which must not reach any arithmetic)."""
    check_2d("old_log_probs", old_log_probs)
    check_same_shape(old_log_probs=old_log_probs, behav_log_probs=behav_log_probs)
    m = as_bool_mask(mask, old_log_probs, like_name="old_log_probs")
    z = _zero(old_log_probs)
    old = torch.where(m, old_log_probs.detach(), z)
    return m, z, old, torch.where(m, behav_log_probs.detach().to(old.dtype), z)


def rollout_log_ratio(old_log_probs: Tensor, behav_log_probs: Tensor, mask: Tensor,
                      max_log_ratio: float = 20.0) -> Tensor:
    """log rho = old - behav per token, clamped to +-max_log_ratio, 0 at padding; detached."""
    m, z, old, behav = _masked_pair(old_log_probs, behav_log_probs, mask)
    return torch.where(m, (old - behav).clamp(-max_log_ratio, max_log_ratio), z)


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor, *, geometric: bool = False,
                       max_log_ratio: float = 20.0) -> Tensor:
    """Per sequence [B]: the sum of its tokens' log-ratios (the log of the product of ratios) or,
    ``geometric``, their mean; clamped to +-max_log_ratio. 0 for a sequence without tokens."""
    check_2d("log_ratio", log_ratio)
    m = as_bool_mask(mask, log_ratio, like_name="log_ratio")
    total = torch.where(m, log_ratio, _zero(log_ratio)).sum(-1)
    if geometric:
        total = total / m.sum(-1).clamp_min(1).to(log_ratio.dtype)
    return total.clamp(-max_log_ratio, max_log_ratio)


def _level_log_ratio(log_ratio: Tensor, m: Tensor, level: str, max_log_ratio: float) -> Tensor:
    """The log-ratio that a token / sequence / geometric level gives each token [B, T]."""
    if level == "token":
        return log_ratio
    if level in ("sequence", "geometric"):
        seq = sequence_log_ratio(log_ratio, m, geometric=level == "geometric", max_log_ratio=max_log_ratio)
        return seq.unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"unknown rollout correction level {level!r}")


def rollout_is_weights(log_ratio: Tensor, mask: Tensor, level: str, cap: float,
                       max_log_ratio: float = 20.0) -> tuple[Tensor, Tensor]:
    """Truncated importance weights [B, T]: min(rho, cap) with rho the token's (``token``), its
    sequence's product (``sequence``) or geometric mean (``geometric``) of ratios; 0 at padding.
    Also the bool [B, T] of real tokens whose weight was cut to ``cap``."""
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"algorithm.rollout_is: must be token, sequence or geometric here, got {level!r}")
    if not cap > 0:
        raise ValueError(f"algorithm.rollout_is_cap: must be > 0, got {cap!r}")
    m = as_bool_mask(mask, log_ratio, like_name="log_ratio")
    raw = torch.exp(_level_log_ratio(log_ratio, m, level, max_log_ratio))
    z = _zero(log_ratio)
    return torch.where(m, raw.clamp(max=cap), z), (raw > cap) & m


def rollout_keep_mask(log_ratio: Tensor, mask: Tensor, level: str, low: float, high: float,
                      max_log_ratio: float = 20.0) -> Tensor:
    """Bool [B, T]: True for the real tokens that stay, False for those dropped and at padding.
    A token is dropped when its level's ratio (see ``rollout_is_weights``) is outside
    [low, high]; ``any_token`` drops a whole sequence when any of its tokens' own ratio is.
    Compared in log space (no overflow); a NaN ratio is outside every band."""
    if level not in ("token", "sequence", "geometric", "any_token"):
        raise ValueError(f"algorithm.rollout_mask: must be token, sequence, geometric or any_token here, "
                         f"got {level!r}")
    if not 0.0 < low < 1.0 < high:
        raise ValueError(f"algorithm.rollout_mask_low / rollout_mask_high: need 0 < low < 1 < high, "
                         f"got {low!r} / {high!r}")
    m = as_bool_mask(mask, log_ratio, like_name="log_ratio")
    lr = _level_log_ratio(log_ratio, m, "token" if level == "any_token" else level, max_log_ratio)
    inside = (lr >= math.log(low)) & (lr <= math.log(high))
    if level == "any_token":
        inside = (inside | ~m).all(-1, keepdim=True).expand_as(m)
    return inside & m


def mismatch_terms(old_log_probs: Tensor, behav_log_probs: Tensor, mask: Tensor,
                   max_log_ratio: float = 20.0) -> dict[str, Tensor]:
    """Per-token measures of the mismatch [B, T], detached, 0 at padding:

    * ``logp_abs_diff``: |behav - old|, in log-prob (nats);
    * ``prob_abs_diff``: |exp(behav) - exp(old)|, in probability (verl's rollout_probs_diff);
    * ``kl``: behav - old, the k1 estimate of KL(behav || old) from the behaviour's samples;
    * ``k3_kl``: (rho - 1) - log rho >= 0, the k3 estimate of the same KL (log rho clamped).
    """
    m, z, old, behav = _masked_pair(old_log_probs, behav_log_probs, mask)
    diff = behav - old
    lr = (-diff).clamp(-max_log_ratio, max_log_ratio)
    terms = {"logp_abs_diff": diff.abs(), "prob_abs_diff": (behav.exp() - old.exp()).abs(), "kl": diff,
             "k3_kl": torch.expm1(lr) - lr}
    return {k: torch.where(m, v, z) for k, v in terms.items()}


@dataclass
class RolloutCorrection:
    """What ``rollout_correction`` found for a batch (all [B, T], detached)."""

    log_ratio: Tensor  # log rho per token, clamped, 0 at padding
    weights: Tensor | None  # rollout_is: the truncated weight of each token (0 at padding); None when off
    capped: Tensor | None  # rollout_is: bool, the token's weight was cut to rollout_is_cap
    keep: Tensor | None  # rollout_mask: bool, the token stays (False where dropped and at padding)


def rollout_correction(old_log_probs: Tensor, behav_log_probs: Tensor, mask: Tensor,
                       cfg: AlgorithmConfig) -> RolloutCorrection:
    """The weights and the mask that ``cfg.rollout_is`` / ``cfg.rollout_mask`` ask for (None
    for one that is off), from the proximal (``old_log_probs``) and behaviour log-probs.
    A ValueError names the key of any bad setting."""
    check_algorithm_config(cfg, ROLLOUT_CORR_KEYS)
    m = as_bool_mask(mask, old_log_probs, like_name="old_log_probs")
    lr = rollout_log_ratio(old_log_probs, behav_log_probs, m, cfg.max_log_ratio)
    weights = capped = keep = None
    if cfg.rollout_is:
        weights, capped = rollout_is_weights(lr, m, cfg.rollout_is, cfg.rollout_is_cap, cfg.max_log_ratio)
    if cfg.rollout_mask:
        keep = rollout_keep_mask(lr, m, cfg.rollout_mask, cfg.rollout_mask_low, cfg.rollout_mask_high,
                                 cfg.max_log_ratio)
    return RolloutCorrection(lr, weights, capped, keep)
