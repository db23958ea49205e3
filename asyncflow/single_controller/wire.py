"""Arguments and results of worker calls on the wire.

The transport codec carries JSON values and tensors. A BatchMeta travels as a tagged
dict (its rows as one tensor frame); tuples become lists. Anything else (a TensorDict,
a model) is refused with a message: samples move through the TransferQueue, not RPC.
"""
from __future__ import annotations

from typing import Any

import torch

from ..transfer_queue.meta import BatchMeta

_META_TAG = "__batch_meta"


def to_wire(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor)):
        return x
    if isinstance(x, BatchMeta):
        return {_META_TAG: x.to_wire()}
    if isinstance(x, (list, tuple)):
        return [to_wire(v) for v in x]
    if isinstance(x, dict):
        if _META_TAG in x:
            raise TypeError(f"dict key {_META_TAG!r} is reserved for BatchMeta on the wire")
        if not all(isinstance(k, str) for k in x):
            raise TypeError("only dicts with str keys can be sent to or from a worker")
        return {k: to_wire(v) for k, v in x.items()}
    raise TypeError(f"{type(x).__name__} cannot be sent to or from a worker: pass JSON values, tensors "
                    "or BatchMeta (move samples through the TransferQueue)")


def from_wire(x: Any) -> Any:
    if isinstance(x, list):
        return [from_wire(v) for v in x]
    if isinstance(x, dict):
        if _META_TAG in x:
            return BatchMeta.from_wire(x[_META_TAG])
        return {k: from_wire(v) for k, v in x.items()}
    return x
