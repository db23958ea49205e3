"""Input validation shared by the algorithm functions: errors that name the bad argument.

A shape mismatch between, say, ``log_probs`` and ``advantages`` would otherwise broadcast
silently or fail with an anonymous torch message deep in a training step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..algorithm_config import AlgorithmConfig


def check_same_shape(**named: Tensor | None) -> None:
    """Raise if the given tensors (None ones skipped) do not all have the first one's shape."""
    items = [(k, v) for k, v in named.items() if v is not None]
    for k, v in items:
        if not isinstance(v, Tensor):
            raise TypeError(f"{k} must be a torch.Tensor, got {type(v).__name__}")
    if not items:
        return
    ref_name, ref = items[0]
    for k, v in items[1:]:
        if v.shape != ref.shape:
            raise ValueError(f"{k} has shape {tuple(v.shape)} but {ref_name} has shape "
                             f"{tuple(ref.shape)}; they must match")


def check_2d(name: str, t: Tensor) -> None:
    """Per-token tensors here are padded [B, T]."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be a [B, T] tensor, got shape {tuple(t.shape)}")


def as_bool_mask(mask: Tensor, like: Tensor, *, name: str = "mask", like_name: str = "values") -> Tensor:
    """The mask as bool (nonzero = real token), checked to have ``like``'s shape."""
    check_same_shape(**{like_name: like, name: mask})
    return mask if mask.dtype == torch.bool else mask != 0


def check_seq_vector(name: str, t: Tensor, batch: int, *, integer: bool = False) -> None:
    """Per-sequence tensors are [B]."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one entry per sequence), "
                         f"got {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")


# Value rules of the AlgorithmConfig fields the algorithm functions read: key -> (test, requirement).
_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "gamma": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "lam": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "eps": (lambda v: v > 0.0, "must be > 0"),
    "clip_low": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "clip_high": (lambda v: v >= 0.0, "must be >= 0"),
    "dual_clip_c": (lambda v: v > 1.0, "must be > 1"),
    "is_cap": (lambda v: v > 0.0, "must be > 0"),
    "tis_cap": (lambda v: v > 0.0, "must be > 0"),
    "max_log_ratio": (lambda v: v > 0.0, "must be > 0"),
    "gspo_clip_low": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "gspo_clip_high": (lambda v: v >= 0.0, "must be >= 0"),
    "cispo_clip_low": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1] (1: no lower bound)"),
    "cispo_clip_high": (lambda v: v >= 0.0, "must be >= 0"),
    "kl_coef": (lambda v: v >= 0.0, "must be >= 0 (0: no reference stage)"),
    "rollout_is_cap": (lambda v: v > 0.0, "must be > 0"),
    "rollout_mask_low": (lambda v: 0.0 < v < 1.0, "must be in (0, 1) (the band [low, high] holds ratio 1)"),
    "rollout_mask_high": (lambda v: v > 1.0, "must be > 1 (the band [low, high] holds ratio 1)"),
}
# Keys whose value is one of a few names ("" = off). The rollout correction's levels: the
# weight or the band applies per token, to a sequence's product of ratios, to their geometric
# mean, or (masks only) to a whole sequence when any of its tokens leaves the band.
ROLLOUT_IS_LEVELS = ("", "token", "sequence", "geometric")
ROLLOUT_MASK_LEVELS = ("", "token", "sequence", "geometric", "any_token")
_CHOICES: dict[str, tuple[str, ...]] = {"rollout_is": ROLLOUT_IS_LEVELS, "rollout_mask": ROLLOUT_MASK_LEVELS}
# Policy losses that already weight by the behaviour ratio exp(old - behav) (capped) themselves:
# algorithm.rollout_is on top would weight every token twice by the same ratio.
SELF_WEIGHTED_LOSSES = ("decoupled_ppo", "tis", "gspo", "cispo")
ADVANTAGE_KEYS = ("gamma", "lam", "eps")
POLICY_LOSS_KEYS = ("clip_low", "clip_high", "dual_clip_c", "is_cap", "tis_cap", "max_log_ratio",
                    "gspo_clip_low", "gspo_clip_high", "cispo_clip_low", "cispo_clip_high")
ROLLOUT_CORR_KEYS = ("rollout_is", "rollout_is_cap", "rollout_mask", "rollout_mask_low", "rollout_mask_high",
                     "max_log_ratio")


def algorithm_config_problems(cfg: AlgorithmConfig, keys: Iterable[str] = (*_RULES, *_CHOICES)) -> list[str]:
    """One line per bad value among ``keys`` of an AlgorithmConfig, named by its key
    (``algorithm.gamma: must be in [0, 1], got 1.5``). config._check reports these at start-up."""
    keys = tuple(keys)
    out = []
    for key in keys:
        v = getattr(cfg, key)
        if key in _CHOICES:
            if v not in _CHOICES[key]:
                out.append(f"algorithm.{key}: must be one of {', '.join(map(repr, _CHOICES[key]))} ('': off), "
                           f"got {v!r}")
            continue
        test, need = _RULES[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and test(float(v))  # NaN fails every test
        if not ok:
            out.append(f"algorithm.{key}: {need}, got {v!r}")
    if "rollout_is" in keys and cfg.rollout_is and cfg.policy_loss in SELF_WEIGHTED_LOSSES:
        out.append(f"algorithm.rollout_is: {cfg.rollout_is!r} with algorithm.policy_loss={cfg.policy_loss} "
                   f"would weight each token twice by exp(old - behav) ({cfg.policy_loss} applies its own capped "
                   "weight); use "
                   f"policy_loss=ppo_clip (or auto) with rollout_is, or rollout_is='' with {cfg.policy_loss}")
    return out


def check_algorithm_config(cfg: AlgorithmConfig, keys: Iterable[str]) -> None:
    """ValueError naming every bad key: the same rules enforced when a function is called directly."""
    problems = algorithm_config_problems(cfg, keys)
    if problems:
        raise ValueError("; ".join(problems))
