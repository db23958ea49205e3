"""The training weights one tensor at a time, gathered across the data-parallel ranks.

For weight sync: a sender never builds the full state dict, it walks the model's tensors in
state-dict order (layer after layer) and gathers each one as it is packed. With FSDP2 a
parameter is a DTensor sharded over the group; ``full_tensor()`` all-gathers it, so EVERY
rank of the group must walk the same tensors in the same order (it is a collective).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


def local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in state-dict order; sharded tensors stay sharded (their ``shape`` is global)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()]


def full_tensors(named: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` whole, on its device: a DTensor is all-gathered (collective),
    a plain tensor is given as it is. The caller copies what it keeps: the gathered
    tensor is freed when the next one is taken."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        DTensor = ()  # type: ignore[assignment]  # noqa: N806
    with torch.no_grad():
        for name, t in named:
            t = t.detach()
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t)
