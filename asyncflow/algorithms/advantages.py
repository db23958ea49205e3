"""Advantage estimators: per-token rewards [B, T] -> (advantages [B, T], returns [B, T]).

All estimators share one signature so a recipe can swap them by name (``ADVANTAGES``)::

    fn(token_rewards, mask, *, group_ids=None, values=None, cfg) -> (advantages, returns)

Outcome rewards are placed on the last real token by the caller (``outcome_to_token_rewards``).
The group-based estimators (grpo, dr_grpo, rloo) use each sequence's *score* = the sum of its
masked token rewards, which is the outcome reward when there is only one.

Conventions, the same for every estimator:
* advantages and returns are 0 wherever ``mask`` is 0, and carry no gradient;
* ``returns`` is the discounted return-to-go of the token rewards (``cfg.gamma``), except for
  ``gae`` where it is advantages + values (the critic's regression target);
* masked positions *inside* a sequence (e.g. tool output in a multi-turn rollout) are skipped
  by the recursions: they add no reward and no discount step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_2d, check_same_shape, check_seq_vector
from .aggregate import masked_sum, masked_whiten
from .registry import ADVANTAGES


@dataclass(frozen=True)
class AdvantageConfig:
    """Knobs of the advantage estimators.

    norm_std: grpo divides by the group std (population std, see ``grpo``).
    eps: added to every std before dividing, so zero-variance groups give 0, not NaN.
    gamma, lam: discount and GAE lambda. 1.0/1.0 is the usual choice for LLM outcome rewards.
    whiten: reinforce_pp and gae whiten their advantages over all valid tokens of the batch
        (PPO practice: a fixed scale keeps the clip range meaningful). Group estimators ignore it.
    """
    norm_std: bool = True
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"AdvantageConfig.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"AdvantageConfig.lam must be in [0, 1], got {self.lam}")
        if not self.eps > 0.0:
            raise ValueError(f"AdvantageConfig.eps must be > 0, got {self.eps}")


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


def _group_stats(scores: Tensor, group_ids: Tensor | None, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (group size, group sum, group population variance), looked up by group."""
    if group_ids is None:
        raise ValueError(f"{name} needs group_ids ([B] long: which prompt each response answers)")
    check_seq_vector("group_ids", group_ids, scores.shape[0], integer=True)
    _, inv = torch.unique(group_ids.to(scores.device), return_inverse=True)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inv, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inv, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, inv, (scores - mean[inv]) ** 2)
    return count[inv], total[inv], (sq / count)[inv]


def _broadcast(per_seq: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, per_seq.unsqueeze(1).expand(m.shape), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device))


@ADVANTAGES.register("grpo")
@torch.no_grad()
def grpo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
         values: Tensor | None = None, cfg: AdvantageConfig = AdvantageConfig()) -> tuple[Tensor, Tensor]:
    """GRPO: (score - group mean) / (group std + eps), broadcast to every token.

    The std is the population std (unbiased=False): it is defined for groups of one (the
    advantage is then 0) and makes the normalised advantages of a group have unit RMS.
    ``values`` is ignored.
    """
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    count, total, var = _group_stats(scores, group_ids, "grpo")
    adv = scores - total / count
    if cfg.norm_std:
        adv = adv / (var.sqrt() + cfg.eps)
    return _broadcast(adv, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("dr_grpo")
@torch.no_grad()
def dr_grpo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
            values: Tensor | None = None, cfg: AdvantageConfig = AdvantageConfig()) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: score - group mean, never divided by the std (``cfg.norm_std`` is ignored),
    which removes GRPO's bias toward groups with low reward variance."""
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    count, total, _ = _group_stats(scores, group_ids, "dr_grpo")
    return _broadcast(scores - total / count, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("rloo")
@torch.no_grad()
def rloo(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
         values: Tensor | None = None, cfg: AdvantageConfig = AdvantageConfig()) -> tuple[Tensor, Tensor]:
    """RLOO: score_i minus the mean score of the *other* members of its group (an unbiased
    baseline); groups of size 1 have no baseline and get advantage 0. No std scaling."""
    r, m = _inputs(token_rewards, mask)
    scores = masked_sum(r, m, dim=-1)
    count, total, _ = _group_stats(scores, group_ids, "rloo")
    others = (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores - (total - scores) / others, torch.zeros_like(scores))
    return _broadcast(adv, m), discounted_returns(r, m, cfg.gamma)


@ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
                 values: Tensor | None = None, cfg: AdvantageConfig = AdvantageConfig()) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over all valid tokens of the
    batch (a global rather than per-group baseline). ``group_ids``/``values`` are ignored;
    with ``cfg.whiten=False`` the raw return-to-go is the advantage."""
    r, m = _inputs(token_rewards, mask)
    returns = discounted_returns(r, m, cfg.gamma)
    adv = masked_whiten(returns, m, eps=cfg.eps) if cfg.whiten else returns
    return adv, returns


@ADVANTAGES.register("gae")
@torch.no_grad()
def gae(token_rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None,
        values: Tensor | None = None, cfg: AdvantageConfig = AdvantageConfig()) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lam) from critic ``values`` [B, T].

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is
    the next real token (V = 0 past the last one: the episode ends there). returns = A + V from
    the *unwhitened* A; the advantages are then whitened over valid tokens if ``cfg.whiten``.
    """
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
        adv = masked_whiten(adv, m, eps=cfg.eps)
    return adv, returns
