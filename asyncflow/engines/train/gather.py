"""The training weights, gathered across the data-parallel ranks, one bucket at a time.

For weight sync: a sender never builds the full state dict; the ranks walk the model's
tensors in state-dict order (layer after layer) together, since gathering a sharded
parameter is a collective over their group: every rank of it must make the same calls in
the same order.

Two ways:
- ``full_tensors``: every rank gets each tensor whole (``DTensor.full_tensor()``, an
  all-gather): for ranks that all feed a rollout instance in their own process.
- ``gather_bucket``: only the bucket's sending rank gets the tensors whole, straight into
  its bucket buffer: the other ranks send it their dim-0 shards point to point (FSDP2's
  sharding), so no rank receives what it will not send, and nothing is copied twice.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch without DTensor: nothing is sharded
    DTensor, Shard = (), None  # type: ignore[assignment, misc]


def local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in state-dict order; sharded tensors stay sharded (their ``shape`` is global)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()]


def full_tensors(named: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` whole, on its device: a DTensor is all-gathered (collective),
    a plain tensor is given as it is. The caller copies what it keeps: the gathered
    tensor is freed when the next one is taken."""
    with torch.no_grad():
        for name, t in named:
            t = t.detach()
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def _row_shards(t: Any) -> Any:
    """The process group of a DTensor sharded on dim 0 over a 1-D mesh, else None."""
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    return t.device_mesh.get_group()


def _rows(dim0: int, parts: int, i: int) -> tuple[int, int]:
    """Rows of part ``i`` when ``dim0`` rows are split as torch.chunk splits them (FSDP2's rule)."""
    c = -(-dim0 // parts) if dim0 else 0
    return min(i * c, dim0), min((i + 1) * c, dim0)


def gather_bucket(named: list[tuple[str, torch.Tensor]], dtypes: list[torch.dtype], dests: list[torch.Tensor] | None,
                  src: int) -> None:
    """Bring every tensor of ``named`` whole, in ``dtypes``, into ``dests`` (views of the bucket
    buffer) on global rank ``src``; the other ranks pass ``dests=None`` and send their shards
    (cast). Collective over the tensors' groups; a tensor not sharded on rows is all-gathered."""
    me = dist.get_rank() if dist.is_initialized() else 0
    ops, keep = [], []
    with torch.no_grad():
        for k, (name, t) in enumerate(named):
            t = t.detach()
            group = _row_shards(t)
            if group is None:  # replicated, plain, or sharded otherwise: whole on every rank
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if me == src:
                    dests[k].copy_(full)
                continue
            local, n = t.to_local(), dist.get_world_size(group)
            if me == src:
                dst = dests[k]
                for i in range(n):
                    lo, hi = _rows(t.shape[0], n, i)
                    peer = dist.get_global_rank(group, i)
                    if peer == me:
                        if local.shape[0] != hi - lo:
                            raise RuntimeError(f"gather_bucket: {name!r} has {local.shape[0]} local rows on rank "
                                               f"{me}, expected {hi - lo} (not torch.chunk's split)")
                        dst[lo:hi].copy_(local)
                    elif hi > lo:
                        ops.append(dist.P2POp(dist.irecv, dst[lo:hi], peer, group))
            elif local.numel():
                part = local.to(dtypes[k]).contiguous()
                keep.append(part)
                ops.append(dist.P2POp(dist.isend, part, src, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
