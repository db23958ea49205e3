"""Dispatch modes: how one driver call becomes per-rank calls, and how replies combine.

A mode is a small record of functions held in a registry (verl's idea, without the
wrapper layers): ``split`` (driver) turns the call's arguments into one ``(args, kwargs)``
per rank of the group, or None for a rank that is not called; ``gather`` (driver) turns
the per-rank results into the value the driver awaits; ``execute`` (worker) runs the
method, by default simply ``fn(*args, **kwargs)``.

Built in:
- ONE_TO_ALL: every rank gets the same arguments; the result is the list of rank results.
- ALL_TO_ALL: every argument is a list with one element per rank; rank i gets element i.
- RANK_ZERO: only the group's first rank is called (the others stay free); its result is
  returned. Use ONE_TO_ALL for a method that runs collectives.
- DP_COMPUTE: the first argument is a BatchMeta, split with ``meta.chunk(dp_size)``; each
  shard leader fetches its share from the TransferQueue and broadcasts it to its shard
  over torch.distributed; the method gets the data (a TensorDict) and returns the new
  columns (a dict or TensorDict, or None); the leader writes them back to the rows it was
  given and only the BatchMeta returns to the driver (concatenated over shards).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ..transfer_queue.meta import BatchMeta
from .layout import GroupLayout

Call = tuple[tuple[Any, ...], dict[str, Any]]  # one rank's (args, kwargs)
# A mode's execute: (worker, its bound method, args, kwargs) -> the method's result.
Execute = Callable[[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_F = TypeVar("_F", bound=Callable[..., Any])
_ATTR = "__asyncflow_dispatch__"


class Dispatch:
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"


def _run(worker: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class DispatchMode:
    name: str
    split: Callable[[GroupLayout, tuple[Any, ...], dict[str, Any]], list[Call | None]]
    gather: Callable[[GroupLayout, list[Any]], Any]
    execute: Execute = _run


DISPATCH_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(mode: DispatchMode) -> DispatchMode:
    if mode.name in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode.name!r} is already registered")
    DISPATCH_MODES[mode.name] = mode
    return mode


def get_dispatch_mode(name: str) -> DispatchMode:
    try:
        return DISPATCH_MODES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch mode {name!r}; registered: {sorted(DISPATCH_MODES)}") from None


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` records on a worker method."""
    mode: str
    timeout_s: float | None = None  # None: the driver's default call timeout
    concurrent: bool = False  # served beside the running call (see ``register``)
    columns: bool = False  # DP_COMPUTE: the rows as a dict of TransferQueue columns (see ``register``)


def register(mode: str = Dispatch.ONE_TO_ALL, *, timeout_s: float | None = None,
             concurrent: bool = False, columns: bool = False) -> Callable[[_F], _F]:
    """Mark a Worker method as callable from the driver with dispatch ``mode``.

    concurrent: the method is served while another call runs on the rank (on a thread of
    the worker's control server, not in the call queue): for a service's control methods
    (new weights, abort, stats, submit) that must never wait behind generation. Such a
    method must be thread-safe against the worker's other methods, runs no collective
    (its order against other calls is not kept) and does not switch colocated roles.

    columns (DP_COMPUTE only): the method gets its rows as a dict of the TransferQueue's
    columns (``transfer_queue.row_lists.rows``/``values`` read them) instead of a TensorDict.
    A TensorDict holds a non-tensor column (answers, metadata) as one tensorclass object per
    row; a method that only reads the values skips building them.
    """
    get_dispatch_mode(mode)  # fail at class definition, not at the first call
    if concurrent and mode == Dispatch.DP_COMPUTE:
        raise ValueError("a concurrent method cannot use DP_COMPUTE (it broadcasts over the shard's group)")
    if columns and mode != Dispatch.DP_COMPUTE:
        raise ValueError(f"columns=True is for DP_COMPUTE methods (the rows they read); mode {mode!r} reads none")

    def mark(fn: _F) -> _F:
        setattr(fn, _ATTR, MethodSpec(mode, timeout_s, concurrent, columns))
        return fn
    return mark


def method_spec(fn: Any) -> MethodSpec | None:
    return getattr(fn, _ATTR, None)


# ---- the built-in modes --------------------------------------------------------------------

def _one_to_all_split(layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call | None]:
    return [(args, kwargs)] * layout.size


def _list_gather(layout: GroupLayout, results: list[Any]) -> list[Any]:
    return results


def _all_to_all_split(layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call | None]:
    n = layout.size
    for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(v, (list, tuple)) or len(v) != n:
            got = f"{type(v).__name__} of length {len(v)}" if isinstance(v, (list, tuple)) else type(v).__name__
            raise ValueError(f"ALL_TO_ALL on role {layout.role!r}: {name} must be a list of {n} "
                             f"(one per rank), got {got}")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)]


def _rank_zero_split(layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call | None]:
    return [(args, kwargs)] + [None] * (layout.size - 1)


def _rank_zero_gather(layout: GroupLayout, results: list[Any]) -> Any:
    return results[0]


def _dp_split(layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call | None]:
    if not args or not isinstance(args[0], BatchMeta):
        raise TypeError(f"DP_COMPUTE on role {layout.role!r}: the first argument must be a BatchMeta, "
                        f"got {type(args[0]).__name__ if args else 'nothing'}")
    parts = args[0].chunk(layout.dp_size)
    return [((parts[layout.shard_of(i)], *args[1:]), kwargs) for i in range(layout.size)]


def _dp_gather(layout: GroupLayout, results: list[Any]) -> Any:
    leaders = [r for i, r in enumerate(results) if layout.is_leader(i)]
    if all(isinstance(r, BatchMeta) for r in leaders):
        filled = [m for m in leaders if len(m)] or leaders[:1]
        return BatchMeta.concat(filled)
    return leaders


def _dp_execute(worker: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Leader fetches, shard receives by broadcast, method computes, leader writes back."""

    meta: BatchMeta = args[0]
    if not len(meta):  # every rank of the shard got the same empty share: nothing to compute
        return meta
    spec = method_spec(fn)
    read = worker.tq.get_columns if spec is not None and spec.columns else worker.tq.get_data
    box = [read(meta) if worker.is_shard_leader else None]
    if worker.shard_group is not None:
        dist.broadcast_object_list(box, src=worker.shard_ranks[0], group=worker.shard_group,
                                   device=worker.collective_device)
    out = fn(box[0], *args[1:], **kwargs)
    if not worker.is_shard_leader:
        return None
    if out is None:
        return meta
    return worker.tq.put(out, meta.partition, meta)


register_dispatch_mode(DispatchMode(Dispatch.ONE_TO_ALL, _one_to_all_split, _list_gather))
register_dispatch_mode(DispatchMode(Dispatch.ALL_TO_ALL, _all_to_all_split, _list_gather))
register_dispatch_mode(DispatchMode(Dispatch.RANK_ZERO, _rank_zero_split, _rank_zero_gather))
register_dispatch_mode(DispatchMode(Dispatch.DP_COMPUTE, _dp_split, _dp_gather, _dp_execute))
