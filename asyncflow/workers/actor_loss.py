"""The actor's glue between the algorithm registries and the training engine: the loss
functions handed to ``TrainEngine.train_step``, and the rollout correction of an update
(``RolloutCorr``: its weights, its mask and its ``rollout_corr/`` metrics)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .. import column_names as col
from ..algorithms import KL_ESTIMATORS, POLICY_LOSSES
from ..algorithms.aggregate import aggregate
from ..algorithms.rollout_corr import mismatch_terms, rollout_correction

# rollout_corr/ metrics: exact means over tokens (or sequences) and maxima over the whole update.
_MEANS = ("logp_abs_diff_mean", "prob_abs_diff_mean", "kl", "k3_kl", "same_version_frac",
          "logp_abs_diff_mean_same_version", "prob_abs_diff_mean_same_version", "is_weight_mean", "is_capped_frac",
          "masked_frac", "masked_seq_frac")
_MAXES = ("logp_abs_diff_max", "prob_abs_diff_max", "logp_abs_diff_max_same_version",
          "prob_abs_diff_max_same_version")


class RolloutCorr:
    """One update's rollout correction (asyncflow.algorithms.rollout_corr) and its metrics.

    It is taken where the proximal log-probs are first known, once per token:

    * ``prepare(fields)`` before ``train_step``, when the update has them as the
      ``old_log_probs`` field (an old_log_prob stage; several optimizer steps; a rollout_mask,
      for which the actor computes them first): it adds the ``rollout_is_weights`` field and
      folds the mask into the engine's ``loss_mask`` field, so that a dropped token counts in
      no normalisation of the loss (the engine treats it as padding);
    * else inside the loss (``policy_loss_fn``), at the update's own forward (one optimizer
      step: the proximal log-probs are the current weights' own). A rollout_mask cannot be
      taken there: the loss's token counts are fixed before the first micro-batch.

    The metrics are sums, counts and maxima over every token seen (``totals``); the actor adds
    them up over the data-parallel ranks and ``metrics`` turns them into ``rollout_corr/...``
    (a mean or max over no token is left out). The mismatch is measured on every model token
    with a behaviour log-prob, before any is dropped; the weight's figures on the tokens trained.
    ``version``: the policy version of the proximal log-probs (update t: version t), for the
    ``..._same_version`` figures over the tokens that the ``token_versions`` field says were
    sampled by that same version.
    """

    def __init__(self, algo: Any, version: int | None = None) -> None:
        self.algo = algo
        self.version = version
        self.prepared = False
        self._num: dict[str, Tensor | float] = dict.fromkeys(_MEANS, 0.0)
        self._den: dict[str, Tensor | float] = dict.fromkeys(_MEANS, 0.0)
        self._max: dict[str, Tensor | float] = {k: float("-inf") for k in _MAXES}

    # ---- accumulation ------------------------------------------------------------------------
    def _mean(self, key: str, values: Tensor, mask: Tensor) -> None:
        self._num[key] = self._num[key] + torch.where(mask, values.double(), 0.0).sum()
        self._den[key] = self._den[key] + mask.sum().double()

    def _maximum(self, key: str, values: Tensor, mask: Tensor) -> None:
        if values.numel():
            top = torch.where(mask, values.double(), float("-inf")).amax()
            prev = self._max[key]
            self._max[key] = torch.maximum(prev, top) if isinstance(prev, Tensor) else top

    def _take(self, old: Tensor, behav: Tensor, mask: Tensor, versions: Tensor | None, corr: Any) -> None:
        """Metrics of one padded batch [B, T] (``mask``: the model tokens) and its correction."""
        mask = mask if mask.dtype == torch.bool else mask != 0
        terms = mismatch_terms(old, behav, mask, self.algo.max_log_ratio)
        for k in ("logp_abs_diff", "prob_abs_diff"):
            self._mean(f"{k}_mean", terms[k], mask)
            self._maximum(f"{k}_max", terms[k], mask)
        self._mean("kl", terms["kl"], mask)
        self._mean("k3_kl", terms["k3_kl"], mask)
        if versions is not None and self.version is not None:
            same = mask & (versions.round() == float(self.version))
            self._mean("same_version_frac", same.double(), mask)
            for k in ("logp_abs_diff", "prob_abs_diff"):
                self._mean(f"{k}_mean_same_version", terms[k], same)
                self._maximum(f"{k}_max_same_version", terms[k], same)
        trained = mask if corr.keep is None else corr.keep
        if corr.weights is not None:
            self._mean("is_weight_mean", corr.weights, trained)
            self._mean("is_capped_frac", corr.capped.double(), trained)
        if corr.keep is not None:
            dropped = mask & ~corr.keep
            self._mean("masked_frac", dropped.double(), mask)
            self._mean("masked_seq_frac", dropped.any(-1).double(), mask.any(-1))

    def take_loss_capped(self, capped: Tensor, mask: Tensor) -> None:
        """decoupled_ppo / tis: their own weight's capped tokens (the ``is_capfrac`` diagnostic)."""
        self._mean("is_capped_frac", capped, mask if mask.dtype == torch.bool else mask != 0)

    # ---- the two places ------------------------------------------------------------------
    def prepare(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Before train_step, with ``old_log_probs`` and ``behav_log_probs`` per row (1-D, the
        response's length): the fields to train with (``fields`` itself is left as it is)."""
        self.prepared = True
        out = dict(fields)
        old, behav = fields[col.OLD_LOG_PROBS], fields[col.BEHAV_LOG_PROBS]
        if not old:  # no rows on this rank
            if self.algo.rollout_is:
                out["rollout_is_weights"] = []
            return out
        lengths = [x.numel() for x in old]

        def pad(rows: list[Tensor], value: float | bool = 0.0) -> Tensor:
            return pad_sequence([x.reshape(-1) for x in rows], batch_first=True, padding_value=value)

        mask = pad([torch.ones(n, dtype=torch.bool) for n in lengths], False)
        if col.LOSS_MASK in fields:  # multi-turn rows: tool tokens have no behaviour log-prob to compare
            mask &= pad([x.reshape(-1) != 0 for x in fields[col.LOSS_MASK]], False)
        o, b = pad([x.float() for x in old]), pad([x.float() for x in behav])
        versions = pad([x.float() for x in fields[col.TOKEN_VERSIONS]]) if col.TOKEN_VERSIONS in fields else None
        corr = rollout_correction(o, b, mask, self.algo)
        self._take(o, b, mask, versions, corr)
        if corr.weights is not None:
            out["rollout_is_weights"] = [corr.weights[i, :n] for i, n in enumerate(lengths)]
        if corr.keep is not None:  # the engine's loss mask: a dropped token becomes like padding
            out[col.LOSS_MASK] = [corr.keep[i, :n].to(torch.int8) for i, n in enumerate(lengths)]
        return out

    def weights_in_loss(self, old: Tensor, behav: Tensor, mask: Tensor, fields: dict[str, Tensor]) -> Tensor | None:
        """The importance weights [b, T] of one micro-batch (None without ``rollout_is``);
        unless ``prepare`` ran, its correction and metrics are taken here."""
        if self.prepared:
            weights = fields.get("rollout_is_weights")
            if self.algo.rollout_is and weights is None:
                raise RuntimeError("rollout correction: prepare() ran but the rollout_is_weights field is missing")
            return weights
        if self.algo.rollout_mask:
            raise ValueError(f"algorithm.rollout_mask={self.algo.rollout_mask!r}: the mask changes the loss's token "
                             "counts, so it is applied before train_step (RolloutCorr.prepare on fields holding "
                             "old_log_probs), not inside the loss")

        corr = rollout_correction(old, behav, mask, self.algo)
        self._take(old, behav, mask, fields.get(col.TOKEN_VERSIONS), corr)
        return corr.weights

    # ---- results -----------------------------------------------------------------------------
    def totals(self) -> tuple[Tensor, Tensor]:
        """(sums: every mean's numerator then every denominator, maxes), float64 on the CPU, in a
        fixed order: add the first up and take the elementwise max of the second over ranks."""
        sums = [float(self._num[k]) for k in _MEANS] + [float(self._den[k]) for k in _MEANS]
        return (torch.tensor(sums, dtype=torch.float64),
                torch.tensor([float(self._max[k]) for k in _MAXES], dtype=torch.float64))

    @staticmethod
    def metrics(sums: Tensor, maxes: Tensor) -> dict[str, float]:
        """``rollout_corr/<key>`` from ``totals`` (summed / maxed over ranks)."""
        n = len(_MEANS)
        out = {f"rollout_corr/{k}": float(sums[i] / sums[n + i]) for i, k in enumerate(_MEANS) if sums[n + i] > 0}
        out.update({f"rollout_corr/{k}": float(maxes[i]) for i, k in enumerate(_MAXES)
                    if maxes[i] > float("-inf")})
        return out


def policy_loss_fn(algo: Any, corr: RolloutCorr | None = None) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """``loss_fn(log_probs, entropy, mask, fields, norm)`` as ``TrainEngine.train_step`` wants it.

    ``corr``: the update's rollout correction (its metrics are read from it afterwards); None:
    a private one (the correction still applies, its metrics go nowhere)."""
    corr = RolloutCorr(algo) if corr is None else corr
    policy = POLICY_LOSSES.get(algo.policy_loss)
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator) if algo.kl_coef > 0 and not algo.kl_in_reward else None

    def agg(x: torch.Tensor, mask: torch.Tensor, norm: Any) -> torch.Tensor:
        return aggregate(x, mask, algo.loss_agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs)

    def loss_fn(log_probs, entropy, mask, fields, norm):
        behav = fields.get(col.BEHAV_LOG_PROBS)
        # Proximal log-probs: recomputed by an old_log_prob stage, or else (one optimizer step
        # per batch) the current weights' own, which is what that stage would have computed.
        old = fields[col.OLD_LOG_PROBS] if col.OLD_LOG_PROBS in fields else log_probs.detach()
        per_token, diag = policy(log_probs, old, fields[col.ADVANTAGES], mask, algo, behav_log_probs=behav)
        if behav is not None:
            weights = corr.weights_in_loss(old, behav, mask, fields)
            if weights is not None:  # rollout_is: detached, 0 at padding
                per_token = per_token * weights
            if "is_capfrac" in diag:  # decoupled_ppo / tis weigh by their own capped ratio
                corr.take_loss_capped(diag["is_capfrac"], mask)
        elif algo.rollout_is or algo.rollout_mask:
            raise ValueError(f"algorithm.rollout_is / rollout_mask ({algo.rollout_is!r} / {algo.rollout_mask!r}) need "
                             "the behav_log_probs field (the update stage must read the behav_log_probs column)")
        loss = agg(per_token, mask, norm)
        m = mask.float()
        denom = m.sum().clamp(min=1)
        metrics = {f"actor/{k}": float((v.float() * m).sum() / denom) for k, v in diag.items()}
        if kl_fn is not None:
            kl = kl_fn(log_probs, fields[col.REF_LOG_PROBS], mask)
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
