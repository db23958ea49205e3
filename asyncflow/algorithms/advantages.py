"""Advantage estimators: per-token rewards [B, T] -> (advantages [B, T], returns [B, T]).

All estimators share one signature so a recipe can swap them by name (``ADVANTAGES``)::

    fn(token_rewards, mask, *, group_ids=None, values=None, cfg=None) -> (advantages, returns)

``cfg`` is the run's ``asyncflow.config.AlgorithmConfig`` (None: its defaults); the estimators
read norm_std, unbiased_std, eps, gamma, lam and whiten, and raise a ValueError naming the key
when one of them is out of range.

Outcome rewards are placed on the last real token by the caller (``outcome_to_token_rewards``).
The group-based estimators (grpo, dr_grpo, rloo) use each sequence's *score* = the sum of its
masked token rewards, which is the outcome reward when there is only one.

Conventions, the same for every estimator:
* advantages and returns are 0 wherever ``mask`` is 0, and carry no gradient;
* ``returns`` is the discounted return-to-go of the token rewards (``cfg.gamma``), except for
  ``gae`` where it is advantages + values (the critic's regression target);
* a group whose scores are all equal gets advantage exactly 0.0 (grpo, dr_grpo, rloo), whatever
  the values and dtype: deviations are taken from one member of the group before averaging;
* masked positions *inside* a sequence (e.g. tool output in a multi-turn rollout) are skipped
  by the recursions: they add no reward and no discount step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..algorithm_config import AlgorithmConfig
from ._checks import ADVANTAGE_KEYS, as_bool_mask, check_2d, check_algorithm_config, check_same_shape, check_seq_vector
from .aggregate import masked_sum, masked_whiten
from .registry import ADVANTAGES

# Estimators whose baseline comes from the other responses to the same prompt: with one response
# per prompt (rollout.n = 1) every advantage is 0 and nothing is learnt.
GROUP_RELATIVE_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo"})


def _config(cfg: AlgorithmConfig | None) -> AlgorithmConfig:
    if cfg is None:
        return AlgorithmConfig()
    check_algorithm_config(cfg, ADVANTAGE_KEYS)
    return cfg


def outcome_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar score [B] on its last real token -> [B, T].

    Rows without any real token (padding rows) get no reward. Integer/bool scores become floats.
    """
    check_2d("mask", mask)
    check_seq_vector("scores", scores, mask.shape[0])
    m = mask != 0
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)  # -1: no real token
    has_any = last >= 0
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    src = torch.where(has_any, scores.detach(), torch.zeros_like(scores))
    out.scatter_(1, last.clamp_min(0).unsqueeze(1), src.unsqueeze(1))
    return out


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_next over real tokens (masked positions skipped), 0 at padding."""
    check_2d("token_rewards", token_rewards)
    m = as_bool_mask(mask, token_rewards, like_name="token_rewards")
    r = torch.where(m, token_rewards, torch.zeros_like(token_rewards))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(m, out, torch.zeros_like(out))


def _inputs(token_rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    check_2d("token_rewards", token_rewards)
    if not token_rewards.is_floating_point():
        raise ValueError(f"token_rewards must be a float tensor, got dtype {token_rewards.dtype}")
    return token_rewards.detach(), as_bool_mask(mask, token_rewards, like_name="token_rewards")


def _group_deviations(scores: Tensor, group_ids: Tensor | None, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: its group's size n, its deviation d = score - group mean, and the group's
    sum of squared deviations.

    The scores are first shifted by the group's first member, so a group of equal scores has
    d == 0.0 exactly (sum/count of equal non-dyadic values such as 0.1 is not the value itself
    in floating point), and the spread is computed at the scale of the differences, not of the
    scores (1e7 + 0.1 vs 1e7 + 0.2 in float32).
    """
    if group_ids is None:
        raise ValueError(f"{name} needs group_ids ([B] long: which prompt each response answers)")
    check_seq_vector("group_ids", group_ids, scores.shape[0], integer=True)
    _, inv = torch.unique(group_ids.to(scores.device), return_inverse=True)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    rows = torch.arange(scores.shape[0], device=scores.device)
    first = torch.full((n_groups,), scores.shape[0], dtype=rows.dtype, device=rows.device)
    first = first.scatter_reduce(0, inv, rows, reduce="amin")  # each group's first row
    shifted = scores - scores[first][inv]
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inv, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, inv, shifted) / count
    dev = shifted - mean[inv]
    sq = torch.zeros_like(count).index_add_(0, inv, dev * dev)
    return count[inv], dev, sq[inv]


def _broadcast(per_seq: Tensor, m: Tensor) -> Tensor:
    zero = torch.zeros((), dtype=per_seq.dtype, device=per_seq.device)
    return torch.where(m, per_seq.unsqueeze(1).expand(m.shape), zero)


@ADVANTAGES.register("grpo")
@torch.no_grad()
def grpo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
         values: Tensor | None = None, cfg: AlgorithmConfig | None = None) -> tuple[Tensor, Tensor]:
    """GRPO: (score - group mean) / (group std + eps), broadcast to every token.

    As verl's ``compute_grpo_outcome_advantage``: the std has Bessel's correction (divide by
    n - 1, ``torch.std``'s default) unless ``cfg.unbiased_std`` is false (population std, which
    gives the normalised advantages of a group unit RMS); ``cfg.norm_std=False`` keeps the
    centred score (= dr_grpo). A group of equal scores gets exactly 0.

    A group of one response gets advantage 0: it has no baseline. verl differs there: it takes
    mean 0 and std 1 for such a group, so its advantage is score / (1 + eps).
    ``values`` is ignored.
    """
    cfg = _config(cfg)
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    count, adv, sq = _group_deviations(scores, group_ids, "grpo")
    if cfg.norm_std:
        if cfg.unbiased_std:
            var = torch.where(count > 1, sq / (count - 1).clamp_min(1), torch.zeros_like(sq))
        else:
            var = sq / count
        adv = adv / (var.sqrt() + cfg.eps)  # a single member or equal scores: 0 / eps = 0
    return _broadcast(adv, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("dr_grpo")
@torch.no_grad()
def dr_grpo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
            values: Tensor | None = None, cfg: AlgorithmConfig | None = None) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: score - group mean, never divided by the std (``cfg.norm_std`` is ignored),
    which removes GRPO's bias toward groups with low reward variance. verl's grpo with
    ``norm_adv_by_std_in_grpo=False``, except that a group of one gets 0 here (verl: its score)."""
    cfg = _config(cfg)
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    _, adv, _ = _group_deviations(scores, group_ids, "dr_grpo")
    return _broadcast(adv, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("rloo")
@torch.no_grad()
def rloo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
         values: Tensor | None = None, cfg: AlgorithmConfig | None = None) -> tuple[Tensor, Tensor]:
    """RLOO: score_i minus the mean score of the *other* members of its group (an unbiased
    baseline), computed as n / (n - 1) * (score_i - group mean). No std scaling. Groups of one
    have no baseline and get advantage 0 (verl's ``compute_rloo_outcome_advantage`` leaves
    their score as the advantage)."""
    cfg = _config(cfg)
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    count, dev, _ = _group_deviations(scores, group_ids, "rloo")
    adv = torch.where(count > 1, dev * count / (count - 1).clamp_min(1), torch.zeros_like(dev))
    return _broadcast(adv, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
                 values: Tensor | None = None, cfg: AlgorithmConfig | None = None) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over all valid tokens of the
    batch (a global rather than per-group baseline). ``group_ids``/``values`` are ignored;
    with ``cfg.whiten=False`` the raw return-to-go is the advantage. The whitening std follows
    ``cfg.unbiased_std`` (verl's masked_whiten: unbiased)."""
    cfg = _config(cfg)
    r, m = _inputs(token_rewards, mask)
    returns = discounted_returns(r, m, cfg.gamma)
    adv = masked_whiten(returns, m, eps=cfg.eps, unbiased=cfg.unbiased_std) if cfg.whiten else returns
    return adv, returns


@ADVANTAGES.register("gae")
@torch.no_grad()
def gae(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
        values: Tensor | None = None, cfg: AlgorithmConfig | None = None) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lam) from critic ``values`` [B, T].

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is
    the next real token (V = 0 past the last one: the episode ends there). returns = A + V from
    the *unwhitened* A; the advantages are then whitened over valid tokens if ``cfg.whiten``
    (std per ``cfg.unbiased_std``, as reinforce_pp).
    """
    cfg = _config(cfg)
    r, m = _inputs(token_rewards, mask)
    if values is None:
        raise ValueError("gae needs values ([B, T] critic predictions)")
    check_same_shape(token_rewards=token_rewards, values=values)
    v = torch.where(m, values.detach().to(r.dtype), torch.zeros_like(r))
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        mt = m[:, t]
        a_t = r[:, t] + cfg.gamma * next_v - v[:, t] + cfg.gamma * cfg.lam * next_a
        next_a = torch.where(mt, a_t, next_a)
        next_v = torch.where(mt, v[:, t], next_v)
        adv[:, t] = torch.where(mt, a_t, torch.zeros_like(a_t))
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if cfg.whiten:
        adv = masked_whiten(adv, m, eps=cfg.eps, unbiased=cfg.unbiased_std)
    return adv, returns
