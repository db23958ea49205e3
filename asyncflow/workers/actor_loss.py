"""The actor's glue between the algorithm registries and the training engine: the loss
functions handed to ``TrainEngine.train_step``."""
from __future__ import annotations

from typing import Any, Callable

import torch


def policy_loss_fn(algo: Any) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """``loss_fn(log_probs, entropy, mask, fields, norm)`` as ``TrainEngine.train_step`` wants it."""
    from ..algorithms import KL_ESTIMATORS, POLICY_LOSSES
    from ..algorithms.aggregate import aggregate

    policy = POLICY_LOSSES.get(algo.policy_loss)
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator) if algo.kl_coef > 0 and not algo.kl_in_reward else None

    def agg(x: torch.Tensor, mask: torch.Tensor, norm: Any) -> torch.Tensor:
        return aggregate(x, mask, algo.loss_agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs)

    def loss_fn(log_probs, entropy, mask, fields, norm):
        behav = fields.get("behav_log_probs")
        # Proximal log-probs: recomputed by an old_log_prob stage, or else (one optimizer step
        # per batch) the current weights' own, which is what that stage would have computed.
        old = fields["old_log_probs"] if "old_log_probs" in fields else log_probs.detach()
        per_token, diag = policy(log_probs, old, fields["advantages"], mask, algo, behav_log_probs=behav)
        loss = agg(per_token, mask, norm)
        m = mask.float()
        denom = m.sum().clamp(min=1)
        metrics = {f"actor/{k}": float((v.float() * m).sum() / denom) for k, v in diag.items()}
        if kl_fn is not None:
            kl = kl_fn(log_probs, fields["ref_log_probs"], mask)
            loss = loss + algo.kl_coef * agg(kl, mask, norm)
            metrics["actor/kl_loss"] = float((kl.detach() * m).sum() / denom)
        if entropy is not None:
            metrics["actor/entropy"] = float((entropy.detach() * m).sum() / denom)
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * agg(entropy, mask, norm)
        metrics["actor/pg_loss"] = float(agg(per_token.detach(), mask, norm))
        return loss, metrics
    return loss_fn


def sft_loss_fn(log_probs, entropy, mask, fields, norm):
    """Negative log-likelihood of the trained target tokens, token-mean over the global batch:
    ``mask`` is the engine's (real target token AND the ``loss_mask`` field, when sft_step got
    masks) and ``norm.num_tokens`` counts exactly those tokens over all ranks."""
    loss = -(log_probs * mask).sum() / max(norm.num_tokens, 1.0)
    return loss, {"sft/nll": float(-(log_probs.detach() * mask).sum() / mask.sum().clamp(min=1))}
