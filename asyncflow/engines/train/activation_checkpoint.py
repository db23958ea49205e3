"""Activation checkpointing per decoder layer: keep only each layer's inputs in forward and
recompute its activations in backward (memory of one layer's activations instead of all of
them, for about a third more compute).

The layer's ``forward`` is wrapped in place, so parameter names and checkpoints are unchanged,
and FSDP2's hooks (registered on the layer's ``__call__``) stay outside the recomputed region:
the layer's parameters are gathered once before forward and once before backward, as without
checkpointing.
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_layers"]

# The layers wrapped so far: a layer wrapped twice would recompute its activations twice.
_CHECKPOINTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def checkpoint_layers(layers: list[nn.Module]) -> None:
    """Make each layer recompute its activations in backward (non-reentrant checkpointing)."""
    for i, layer in enumerate(layers):
        if layer in _CHECKPOINTED:
            raise RuntimeError(f"decoder layer {i} ({type(layer).__name__}) is already checkpointed")
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
        _CHECKPOINTED.add(layer)
