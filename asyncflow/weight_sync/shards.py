"""The training weights, tensor by tensor, for weight sync.

A sender never builds the full state dict: the ranks walk the model's tensors in
state-dict order (layer after layer) together, since gathering a sharded parameter is a
collective over their group: every rank of it must make the same calls in the same order.

- ``whole``: a tensor whole on every rank (``DTensor.full_tensor()``, an all-gather): for
  ranks that feed a rollout instance in their own process, and tensors not sharded by rows.
- ``row_shard_group`` and ``chunk_rows``: which tensors are FSDP2 dim-0 shards and which
  rows each rank holds, so that each rank can send its own rows and nothing is gathered.
"""
from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor as DTensor  # re-exported: send.py's isinstance checks
    from torch.distributed.tensor import Shard
except ImportError:  # a torch without DTensor: nothing is sharded
    DTensor, Shard = (), None  # type: ignore[assignment, misc]


def local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in state-dict order; sharded tensors stay sharded (their ``shape`` is global)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()]


def row_shard_group(t: Any) -> Any:
    """The process group of a DTensor sharded on dim 0 over a 1-D mesh, else None."""
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    return t.device_mesh.get_group()


def chunk_rows(dim0: int, parts: int, i: int) -> tuple[int, int]:
    """Rows of part ``i`` when ``dim0`` rows are split as torch.chunk splits them (FSDP2's rule)."""
    c = -(-dim0 // parts) if dim0 else 0
    return min(i * c, dim0), min((i + 1) * c, dim0)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor is all-gathered (a collective: every rank of its mesh calls it)."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_rows(t: torch.Tensor, name: str, rows: tuple[int, int]) -> torch.Tensor:
    """This rank's shard of a dim-0-sharded DTensor, checked to be ``rows`` of the whole."""
    local: torch.Tensor = cast(DTensor, t.detach()).to_local()
    if local.shape[0] != rows[1] - rows[0]:
        raise RuntimeError(f"{name!r} has {local.shape[0]} local rows on rank {dist.get_rank()}, expected "
                           f"{rows[1] - rows[0]} (rows {rows[0]}:{rows[1]}: not torch.chunk's split)")
    return local
