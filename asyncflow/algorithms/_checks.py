"""Input validation shared by the algorithm functions: errors that name the bad argument.

A shape mismatch between, say, ``log_probs`` and ``advantages`` would otherwise broadcast
silently or fail with an anonymous torch message deep in a training step.
"""
from __future__ import annotations

import torch
from torch import Tensor


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
