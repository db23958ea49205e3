"""The actor's glue between the algorithm registries and the training engine: advantages
for a batch, and the loss function handed to ``TrainEngine.train_step``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .common import pad, unpad


@dataclass
class AlgoSettings:
    advantage: str = "grpo"
    norm_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 3.0
    is_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0

    @staticmethod
    def from_dict(d: dict) -> "AlgoSettings":
        known = {k: v for k, v in d.items() if k in AlgoSettings.__dataclass_fields__}
        return AlgoSettings(**known)


def compute_advantages(algo: AlgoSettings, scores: torch.Tensor, groups: torch.Tensor,
                       lengths: list[int], *, values: list[torch.Tensor] | None = None,
                       log_probs: list[torch.Tensor] | None = None,
                       ref_log_probs: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token advantages and returns, one 1-D tensor per row (the whole batch at once:
    group baselines need every member of a group)."""
    from ..algorithms import ADVANTAGES
    from ..algorithms.advantages import AdvantageConfig, outcome_to_token_rewards
    from ..algorithms.kl import kl_penalty_to_reward

    mask = torch.zeros(len(lengths), max(lengths, default=1), dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    token_rewards = outcome_to_token_rewards(scores.float(), mask)
    if algo.kl_in_reward and algo.kl_coef > 0:
        lp, _ = pad(log_probs)
        ref, _ = pad(ref_log_probs)
        token_rewards = kl_penalty_to_reward(token_rewards, lp, ref, mask, algo.kl_coef, algo.kl_estimator)
    vals = pad(values)[0] if values is not None else None
    cfg = AdvantageConfig(norm_std=algo.norm_std, gamma=algo.gamma, lam=algo.lam)
    adv, ret = ADVANTAGES.get(algo.advantage)(token_rewards, mask, group_ids=groups.long(), values=vals, cfg=cfg)
    return unpad(adv, mask), unpad(ret, mask)


def policy_loss_fn(algo: AlgoSettings) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """``loss_fn(log_probs, entropy, mask, fields, norm)`` as ``TrainEngine.train_step`` wants it."""
    from ..algorithms import KL_ESTIMATORS, POLICY_LOSSES
    from ..algorithms.aggregate import aggregate
    from ..algorithms.policy_loss import PolicyLossConfig

    pcfg = PolicyLossConfig(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip_c=algo.dual_clip_c,
                            is_cap=algo.is_cap)
    policy = POLICY_LOSSES.get(algo.policy_loss)
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator) if algo.kl_coef > 0 and not algo.kl_in_reward else None

    def agg(x: torch.Tensor, mask: torch.Tensor, norm: Any) -> torch.Tensor:
        return aggregate(x, mask, algo.loss_agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs)

    def loss_fn(log_probs, entropy, mask, fields, norm):
        behav = fields.get("behav_log_probs")
        # Proximal log-probs: recomputed by an old_log_prob stage, or else (one optimizer step
        # per batch) the current weights' own, which is what that stage would have computed.
        old = fields["old_log_probs"] if "old_log_probs" in fields else log_probs.detach()
        per_token, diag = policy(log_probs, old, fields["advantages"], mask, pcfg, behav_log_probs=behav)
        loss = agg(per_token, mask, norm)
        m = mask.float()
        denom = m.sum().clamp(min=1)
        metrics = {f"actor/{k}": float((v.float() * m).sum() / denom) for k, v in diag.items()}
        if kl_fn is not None:
            kl = kl_fn(log_probs, fields["ref_log_probs"], mask)
            loss = loss + algo.kl_coef * agg(kl, mask, norm)
            metrics["actor/kl"] = float((kl.detach() * m).sum() / denom)
        if entropy is not None:
            metrics["actor/entropy"] = float((entropy.detach() * m).sum() / denom)
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * agg(entropy, mask, norm)
        metrics["actor/pg_loss"] = float(agg(per_token.detach(), mask, norm))
        return loss, metrics
    return loss_fn


def sft_loss_fn(log_probs, entropy, mask, fields, norm):
    """Negative log-likelihood of the target tokens, token-mean over the global batch."""
    loss = -(log_probs * mask).sum() / max(norm.num_tokens, 1.0)
    return loss, {"sft/nll": float(-(log_probs.detach() * mask).sum() / mask.sum().clamp(min=1))}
