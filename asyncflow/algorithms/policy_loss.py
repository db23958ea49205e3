"""Policy-gradient losses: per-token loss [B, T] (unaggregated) plus per-token diagnostics.

Uniform signature, so a recipe can name one (``POLICY_LOSSES``)::

    fn(log_probs, old_log_probs, advantages, mask, cfg, *, behav_log_probs=None)
        -> (loss [B, T], {"pg_clipfrac", "ppo_kl", "ratio", ...: [B, T]})

``cfg`` is the run's ``asyncflow.config.AlgorithmConfig``; the losses read clip_low, clip_high,
dual_clip_c, is_cap, tis_cap, max_log_ratio, gspo_clip_low / gspo_clip_high and cispo_clip_low /
cispo_clip_high, and raise a ValueError naming the key when one of them is out of range.

Gradients flow into ``log_probs`` only (everything else is detached). Loss and diagnostics are
0 where ``mask`` is 0, whatever the padding holds; aggregate both with ``aggregate(..., mask)``.
Diagnostics are detached: 0/1 indicator tensors for the "...frac" entries, values otherwise.
Their token means are logged as ``actor/<key>``; the keys that verl also logs carry verl's
names and definitions (``compute_policy_loss_vanilla``):

* ``pg_clipfrac``: the clipped branch of the PPO surrogate is the larger (the token's gradient is cut);
* ``ppo_kl``: k1 estimate of KL(old || new), old_log_prob - log_prob (may be negative per batch);
* ``pg_clipfrac_lower`` (dual_clip only): A < 0 and the loss is capped at dual_clip_c * -A.

AsyncFlow's own: ``pg_clipfrac_ratio_high`` / ``pg_clipfrac_ratio_low`` split pg_clipfrac by
the bound that clipped (r > 1 + clip_high with A > 0, r < 1 - clip_low with A < 0); ``ppo_kl_k3``
is the k3 estimate (r - 1) - log r >= 0; ``ratio`` is r; ``is_weight`` and ``is_capfrac`` are the
importance weight of decoupled_ppo / tis and the fraction of tokens where it hit its cap.

The same keys, where a loss defines them otherwise:

* ``gspo``: ``ratio`` is the sequence ratio s_i at each token of sequence i; ``pg_clipfrac``
  (and its high / low split) marks the tokens of sequences whose clipped branch wins; ``ppo_kl``
  and ``ppo_kl_k3`` stay per token; ``is_weight`` / ``is_capfrac`` (with behav_log_probs) are the
  sequence's behaviour weight and whether it hit is_cap, at each of its tokens.
* ``cispo``: ``ratio`` is the importance ratio against the sampling policy (behav_log_probs when
  given, else old_log_probs); ``pg_clipfrac`` marks the tokens whose weight sits at a bound
  (``..._ratio_high``: above 1 + cispo_clip_high, ``..._ratio_low``: below 1 - cispo_clip_low),
  whatever the advantage's sign, for no gradient is cut; ``is_weight`` / ``is_capfrac`` (with
  behav_log_probs) are the clipped weight and ``pg_clipfrac_ratio_high``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..algorithm_config import AlgorithmConfig
from ._checks import POLICY_LOSS_KEYS, as_bool_mask, check_algorithm_config, check_same_shape
from .aggregate import masked_mean
from .registry import POLICY_LOSSES


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _prepare(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
             behav_log_probs: Tensor | None, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Validated bool mask, and detached old log-probs and advantages zeroed at padding."""
    check_algorithm_config(cfg, POLICY_LOSS_KEYS)
    check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     mask=mask, behav_log_probs=behav_log_probs)
    m = as_bool_mask(mask, log_probs, like_name="log_probs")
    z = _zero(log_probs)
    # where() before any arithmetic: padding may hold -inf/NaN, which must not reach exp or grads.
    old = torch.where(m, old_log_probs.detach().to(log_probs.dtype), z)
    adv = torch.where(m, advantages.detach().to(log_probs.dtype), z)
    return m, old, adv


def _clipped_surrogate(log_probs: Tensor, old: Tensor, adv: Tensor, m: Tensor,
                       cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
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
        lr = log_ratio.detach()
        metrics = {
            "pg_clipfrac": active.to(log_probs.dtype),
            "pg_clipfrac_ratio_high": (active & (adv > 0)).to(log_probs.dtype),  # r > 1 + clip_high
            "pg_clipfrac_ratio_low": (active & (adv < 0)).to(log_probs.dtype),  # r < 1 - clip_low
            "ratio": torch.where(m, r, z),
            # verl's ppo_kl: k1 estimate of KL(old || new), old - new log-prob (0 at padding: lr is).
            "ppo_kl": torch.where(m, -lr, z),
            # k3 estimate of the same KL from samples of old: (r - 1) - log r >= 0.
            "ppo_kl_k3": torch.where(m, (r - 1.0) - lr, z),
        }
    return torch.where(m, loss, z), metrics


@POLICY_LOSSES.register("ppo_clip")
@POLICY_LOSSES.register("clip_higher")
def ppo_clip(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
             cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Standard PPO clipped surrogate. Registered also as ``clip_higher`` (DAPO): the same
    function, asymmetric through ``cfg.clip_high > cfg.clip_low``. ``behav_log_probs`` is ignored."""
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs, cfg)
    return _clipped_surrogate(log_probs, old, adv, m, cfg)


@POLICY_LOSSES.register("dual_clip")
def dual_clip(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
              cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: for A < 0 the PPO loss grows without bound in the ratio; cap it at
    ``dual_clip_c * -A`` so one very off-policy token cannot dominate. Same as ppo_clip for A >= 0.
    This is verl's default policy loss, registered also under verl's name ``vanilla``."""
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs, cfg)
    loss, metrics = _clipped_surrogate(log_probs, old, adv, m, cfg)
    bound = -adv * cfg.dual_clip_c
    neg = adv < 0
    out = torch.where(neg, torch.minimum(loss, bound), loss)
    with torch.no_grad():
        metrics["pg_clipfrac_lower"] = (neg & (loss > bound) & m).to(log_probs.dtype)  # verl's name
    return out, metrics


POLICY_LOSSES.alias("vanilla", "dual_clip")  # verl: actor.policy_loss.loss_mode=vanilla


def _importance_weighted(name: str, cap: float, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                         mask: Tensor, cfg: AlgorithmConfig,
                         behav_log_probs: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """min(exp(old - behav), cap) (detached) times the PPO-clip surrogate relative to ``old``."""
    if behav_log_probs is None:
        raise ValueError(f"{name} needs behav_log_probs (the rollout engine's log-probs of the sampled "
                         f"tokens); old_log_probs must be the trainer's recomputed log-probs")
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs, cfg)
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
                  cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
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
        cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with truncated importance sampling, for the rollout-vs-trainer numerical
    mismatch (e.g. vLLM vs FSDP kernels): the surrogate times min(exp(old - behav), tis_cap),
    detached. Same formula as decoupled_ppo with its own cap; the intent differs (numerics,
    not staleness)."""
    return _importance_weighted("tis", cfg.tis_cap, log_probs, old_log_probs, advantages,
                                mask, cfg, behav_log_probs)


def _sequence_mean(values: Tensor, m: Tensor) -> Tensor:
    """[B, 1]: each row's mean over its real tokens (0 for a row of padding only)."""
    return masked_mean(values, m, dim=-1).unsqueeze(-1)


@POLICY_LOSSES.register("gspo")
def gspo(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
         cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Group Sequence Policy Optimization): the PPO surrogate on a sequence-level ratio.

    s_i = exp(mean over sequence i's real tokens of (log_prob - old)), the length-normalised
    likelihood ratio, clipped to [1 - gspo_clip_low, 1 + gspo_clip_high] per sequence. In the
    paper's GSPO-token form every token t carries s_i,t = sg[s_i] * exp(log_prob_t - sg[log_prob_t]):
    its value is s_i and its gradient s_i times the token's own, so aggregated with
    ``seq-mean-token-mean`` the gradient is the paper's sequence-level one. Every ``loss_agg``
    mode applies as to any per-token loss.

    Against verl's ``compute_policy_loss_gspo`` (the same ratio and clip): verl reads the PPO keys
    clip_ratio_low / clip_ratio_high, here gspo_clip_low / gspo_clip_high (defaults 3e-4 / 4e-4);
    verl aggregates with seq-mean-token-mean whatever its loss_agg_mode, here algorithm.loss_agg
    decides (set it to seq-mean-token-mean for the paper's weighting); verl clamps the log-ratio
    above at 10, here at +-max_log_ratio (a clamped sequence passes no gradient, as there).

    With ``behav_log_probs`` (the rollout engine's log-probs: staleness and engine mismatch) the
    loss of sequence i is weighted by min(exp(mean over its tokens of (old - behav)), is_cap),
    detached: decoupled_ppo's correction taken per sequence, as GSPO takes its ratio. So
    algorithm.rollout_is is refused beside it (the same ratio twice); verl instead multiplies its
    gspo loss by whatever rollout-correction weights its rollout_is setting computes.
    """
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs, cfg)
    z = _zero(log_probs)
    lp = torch.where(m, log_probs, z)
    mlr = cfg.max_log_ratio
    seq_log_ratio = _sequence_mean(lp.detach() - old, m)  # [B, 1]
    log_ratio = (lp - lp.detach() + seq_log_ratio).clamp(-mlr, mlr)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.gspo_clip_low, 1.0 + cfg.gspo_clip_high)
    loss = torch.where(m, torch.maximum(unclipped, clipped), z)
    with torch.no_grad():
        active = (clipped > unclipped) & m
        token_lr = (lp - old).clamp(-mlr, mlr)
        metrics = {
            "pg_clipfrac": active.to(log_probs.dtype),
            "pg_clipfrac_ratio_high": (active & (adv > 0)).to(log_probs.dtype),
            "pg_clipfrac_ratio_low": (active & (adv < 0)).to(log_probs.dtype),
            "ratio": torch.where(m, ratio.detach(), z),  # s_i at each token of sequence i
            "ppo_kl": torch.where(m, -token_lr, z),  # per token, as verl's gspo logs it
            "ppo_kl_k3": torch.where(m, (torch.exp(token_lr) - 1.0) - token_lr, z),
        }
        if behav_log_probs is None:
            return loss, metrics
        behav = torch.where(m, behav_log_probs.detach().to(log_probs.dtype), z)
        raw = torch.exp(_sequence_mean(old - behav, m).clamp(-mlr, mlr))  # [B, 1]
        weight = torch.where(m, raw.clamp(max=cfg.is_cap), z)
        metrics["is_weight"] = weight
        metrics["is_capfrac"] = ((raw > cfg.is_cap) & m).to(log_probs.dtype)
    return loss * weight, metrics


@POLICY_LOSSES.register("cispo")
def cispo(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
          cfg: AlgorithmConfig, *, behav_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): REINFORCE weighted by a clipped, stop-gradient importance weight.

    loss_t = -sg[clip(r_t, 1 - cispo_clip_low, 1 + cispo_clip_high)] * A_t * log_prob_t. Unlike
    the PPO surrogate no token's gradient is ever cut: a clipped weight only bounds how much the
    token counts. The paper normalises by the group's token count: ``loss_agg=token-mean``.

    r_t is the importance ratio against the policy that sampled the tokens: exp(log_prob -
    behav) with ``behav_log_probs`` (the rollout engine's: in async mode the stale policy), else
    exp(log_prob - old). CISPO has no trust region around a proximal policy, so the whole
    off-policy correction is its one clipped weight; algorithm.rollout_is is refused beside it.
    verl's ``cispo`` clips with the PPO keys clip_ratio_low / clip_ratio_high against its
    old_log_prob; here cispo_clip_low / cispo_clip_high (defaults 1 / 3: no floor, a ceiling of 4).
    """
    m, old, adv = _prepare(log_probs, old_log_probs, advantages, mask, behav_log_probs, cfg)
    z = _zero(log_probs)
    lp = torch.where(m, log_probs, z)
    mlr = cfg.max_log_ratio
    low, high = 1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high
    with torch.no_grad():
        sampler = old if behav_log_probs is None else torch.where(m, behav_log_probs.detach().to(lp.dtype), z)
        ratio = torch.exp((lp - sampler).clamp(-mlr, mlr))
        weight = torch.where(m, ratio.clamp(low, high), z)
        above, below = (ratio > high) & m, (ratio < low) & m
        token_lr = (lp - old).clamp(-mlr, mlr)
        metrics = {
            "pg_clipfrac": (above | below).to(log_probs.dtype),  # the weight sits at a bound
            "pg_clipfrac_ratio_high": above.to(log_probs.dtype),
            "pg_clipfrac_ratio_low": below.to(log_probs.dtype),
            "ratio": torch.where(m, ratio, z),
            "ppo_kl": torch.where(m, -token_lr, z),
            "ppo_kl_k3": torch.where(m, (torch.exp(token_lr) - 1.0) - token_lr, z),
        }
        if behav_log_probs is not None:
            metrics["is_weight"] = weight
            metrics["is_capfrac"] = above.to(log_probs.dtype)
    return torch.where(m, -weight * adv * lp, z), metrics
