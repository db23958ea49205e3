"""Build a model without memory, shard it, then give each rank only its shard of the weights.

The order (what lets a 32B model start on 64 GB devices):
1. build the architecture with its parameters on the meta device (`parameters_on_meta`): no
   memory, no initialisation cost; buffers that modules compute in their constructor (rotary
   frequencies) stay real;
2. shard it (`fully_shard`, parameters still on meta);
3. `materialize`: allocate each rank's shards on the device (uninitialised);
4. `fill`: each parameter's shard receives its rows, either read by the rank itself from the
   checkpoint files (`WeightReader`, e.g. safetensors slices) or broadcast from the group's
   first rank one full tensor at a time (a model built there with real weights, e.g. a random
   init, and what a checkpoint does not hold, such as a critic's fresh value head).

No rank ever holds the full model on its device: at most one full tensor at a time during a
broadcast.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["WeightReader", "fill", "materialize", "parameters_on_meta", "real_tensors", "shard_rows", "tensor_names"]

_patch_lock = threading.RLock()  # reentrant: a build inside a build restores what it found
_PATCH_WAIT_S = 600.0  # another thread's build of a large model may take minutes


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers moves to the meta device at once (before the
    module initialises it, so initialisation costs nothing); buffers are left as built.

    It patches ``nn.Module.register_parameter`` for the duration, process-wide: build nothing
    else on another thread meanwhile (a lock keeps two builds of this kind apart)."""
    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    if not _patch_lock.acquire(timeout=_PATCH_WAIT_S):
        raise TimeoutError(f"parameters_on_meta: another thread has been building a model on the meta device for "
                           f"over {_PATCH_WAIT_S:.0f} s")
    try:
        original = nn.Module.register_parameter  # (inside the lock: what an enclosing build installed)
        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]  # patched for this build only
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]  # the build's patch undone
    finally:
        _patch_lock.release()


@runtime_checkable
class _ShardedTensor(Protocol):
    """What ``shard_rows`` reads of a DTensor (not imported: torch.distributed.tensor is slow to
    import, and a plain tensor is told apart by these attributes alone)."""

    placements: Any
    device_mesh: Any

    def to_local(self) -> Tensor: ...


class WeightReader(Protocol):
    """Named tensors a rank can read for itself (e.g. asyncflow.models.loading.SafetensorsWeights)."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, rows: tuple[int, int] | None = None) -> Tensor: ...


def tensor_names(model: nn.Module) -> dict[str, list[str]]:
    """Each distinct parameter and buffer under its first name -> all its names (tied weights
    have several: a checkpoint may hold any of them)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    items = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in items:
        key = first.setdefault(id(tensor), name)
        names.setdefault(key, []).append(name)
    return names


def real_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer not on the meta device, by first name, as aliases that survive
    `materialize` (call it before sharding: these are the full tensors)."""
    out = {}
    for name, _ in tensor_names(model).items():
        tensor = model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)
        if tensor.device.type != "meta":
            out[name] = tensor.detach()
    return out


def _is_parameter(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in (model.get_submodule(owner) if owner else model)._parameters


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate every parameter and buffer on ``device``, uninitialised (`fill` writes them).

    With torch's swap-on-conversion semantics, which keep each Parameter object: tied weights
    stay one parameter (FSDP2's sharded parameters keep theirs either way)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def shard_rows(tensor: Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dim 0 this rank holds of a parameter that FSDP2 sharded on
    dim 0 over a 1-D mesh (torch.chunk's split: ceil(n / world) rows each, the last ranks
    fewer or none); None for a tensor held whole (plain, or replicated)."""
    if not isinstance(tensor, _ShardedTensor):
        return None
    placements = tensor.placements
    if len(placements) != 1:
        raise NotImplementedError(f"a parameter on a {len(placements)}-D mesh: only 1-D (FSDP) sharding is loaded")
    placement = placements[0]
    if placement.is_replicate():
        return None
    if not placement.is_shard(0):
        raise NotImplementedError(f"a parameter with placement {placement}: only Shard(0) is loaded")
    mesh = tensor.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = tensor.shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    held = tensor.to_local().shape[0]
    if held != stop - start:
        raise RuntimeError(f"mesh rank {rank}: holds {held} rows of a {n}-row parameter, expected "
                           f"{stop - start} (torch.chunk's split over {world} ranks); FSDP's layout changed")
    return start, stop


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def fill(model: nn.Module, *, reader: WeightReader | None, source_names: dict[str, str],
         rank0_tensors: dict[str, Tensor], group: dist.ProcessGroup | None, device: torch.device,
         where: str, rank: int = 0) -> dict[str, int]:
    """Write every parameter and buffer of a materialized ``model`` (sharded or not).

    A tensor whose checkpoint name (``source_names`` maps the model's names to the reader's,
    default: the same) is in ``reader`` is read by each rank for its own rows; every other one
    is broadcast from the group's first rank, which must hold it in ``rank0_tensors`` (the other
    ranks' entries are not read). Every rank must call it (collective on ``group``).
    Returns how many tensors came each way ("read", "broadcast"). ``where`` names the weights
    in errors."""
    names = tensor_names(model)
    available = reader.names() if reader is not None else set()
    stored_as = {name: next((source_names.get(a, a) for a in aliases if source_names.get(a, a) in available), None)
                 for name, aliases in names.items()}
    missing = [n for n, stored in stored_as.items() if stored is None and n not in rank0_tensors] if rank == 0 else []
    _agree_or_raise(missing, names, source_names, group, device, where, rank)
    counts = {"read": 0, "broadcast": 0}
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for name, stored in stored_as.items():
        target = model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)
        rows = shard_rows(target)
        local = _local(target)
        if stored is not None:
            assert reader is not None
            shape = reader.shape(stored)
            if shape != list(target.shape):
                raise ValueError(f"rank {rank}: {where}: {stored!r} has shape {shape}, the model's {name!r} "
                                 f"{list(target.shape)}; the checkpoint does not match its config.json")
            local.copy_(reader.read(stored, rows))
            counts["read"] += 1
        elif group is None:
            local.copy_(rank0_tensors[name])
            counts["broadcast"] += 1
        else:
            full = (rank0_tensors[name].to(device=device, dtype=target.dtype) if rank == 0
                    else torch.empty(target.shape, dtype=target.dtype, device=device))
            dist.broadcast(full, src=src, group=group)
            local.copy_(full if rows is None else full[rows[0]:rows[1]])
            counts["broadcast"] += 1
    return counts


def _agree_or_raise(missing: list[str], names: dict[str, list[str]], source_names: dict[str, str],
                    group: dist.ProcessGroup | None, device: torch.device, where: str, rank: int) -> None:
    """Raise on every rank (not only on the first, leaving the others in a broadcast) when the
    first rank lacks weights for some tensor."""
    flag = torch.tensor([float(len(missing))], device=device)
    if group is not None:
        dist.broadcast(flag, src=dist.get_global_rank(group, 0), group=group)
    if flag.item() == 0:
        return
    if missing:
        shown = {n: [source_names.get(a, a) for a in names[n]] for n in missing[:8]}
        raise KeyError(f"rank {rank}: {where}: no weights for {len(missing)} tensors, e.g. {shown} "
                       "(model name: the names looked up): the checkpoint lacks them and they were built on the "
                       "meta device")
    raise KeyError(f"rank {rank}: {where}: the group's first rank found no weights for {int(flag.item())} tensors "
                   "(its error names them)")
