"""Entropy of the policy's next-token distribution, for an entropy bonus or as a diagnostic."""
from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last dim: logits [..., V] -> [...].

    Computed from log_softmax (no overflow for large logits); entries with -inf logits
    (masked vocabulary) have p = 0 and contribute 0 rather than 0 * -inf = NaN. Half-precision
    logits are upcast to float32, which costs memory on [B, T, V]: chunk over B or T if needed.
    """
    if not isinstance(logits, Tensor) or logits.dim() < 1:
        raise ValueError(f"logits must be a tensor [..., V], got {getattr(logits, 'shape', type(logits))}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    # Zero the log *before* multiplying: where(p > 0, p * logp, 0) would still back-propagate
    # 0 * -inf = NaN through the unselected branch.
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=x.dtype, device=x.device))
    return -(p * safe_logp).sum(dim=-1)
