"""Clients of the TransferQueue: an async one for the driver, a blocking one for workers.

A client talks to the controller for metadata and straight to the storage units for
bytes, over persistent connections. Reads are routed by row id (the unit is in the
id's high bits) or by the meta's per-column locations, so fetching data does not ask
the controller. A client with a preferred unit (by default the unit of its node, see
``locality``) writes there: new rows, and columns it adds to rows living elsewhere.
Both clients share the request planning and reply assembly below; they differ only in
how they wait.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio

from ..cpu_account import charged
from ..rpc.async_client import RpcClient
from ..rpc.blocking_client import BlockingRpcClient
from ..rpc.thread_endpoint import ThreadEndpoint, in_process
from .columns import Column, column_from_wire, column_to_wire, concat, to_columns, to_tensordict
from .errors import BadPutError, TransferQueueError, TransferQueueTimeout
from .locality import local_node, local_unit
from .meta import BatchMeta, ids_from_wire, ids_to_wire
from .meta import ReadRequest as _Request
from .meta import plan_reads as _plan_get
from .meta import positions_by_unit as _positions_by_unit
from .new_partition import NewPartition
from .samplers import SamplerSpec

if TYPE_CHECKING:  # tensordict is imported where a TensorDict is built (columns.to_tensordict)
    from tensordict import TensorDict

# Added to a server-side wait so the reply (or its error) can arrive before the client gives up.
_REPLY_MARGIN_S = 10.0


# ---- planning shared by both clients ------------------------------------------------------

# One request of a put: (storage unit, or None for the unit that takes new rows; the put's args).
_UnitCall = tuple[int | None, dict[str, Any]]


@charged("tq_client")
def _plan_put(data: Any, partition: str, meta: BatchMeta | None, groups: Sequence[int] | None,
              target: int | None = None, create: NewPartition | None = None) -> tuple[list[str], list[_UnitCall]]:
    """Validate a put and split it into unit requests: ``(unit or None for new rows, args)``.
    Columns added to existing rows go to ``target`` when given (the writer's own unit),
    else to each row's home unit."""
    if create is not None and meta is not None:
        raise BadPutError(f"put into {partition!r}: create= is for a put of new rows (no meta); these rows "
                          "exist already, so their partition does too")
    cols, n = to_columns(data)
    names = list(cols)
    if meta is None:
        if groups is not None:
            groups = [int(g) for g in groups]
            if len(groups) != n:
                raise BadPutError(f"put into {partition!r}: {len(groups)} group ids for {n} rows")
        wire = {k: column_to_wire(c) for k, c in cols.items()}
        args = {"partition": partition, "columns": wire, "groups": ids_to_wire(groups) if groups is not None else None}
        if create is not None:
            args["create"] = {"tasks": _task_list(partition, create.tasks), "close_at": create.close_at}
        return names, [(None, args)]
    if groups is not None:
        raise BadPutError("groups are set when rows are created; this put adds columns to existing rows")
    if meta.partition != partition:
        raise BadPutError(f"meta is of partition {meta.partition!r}, put targets {partition!r}")
    if len(meta) != n:
        raise BadPutError(f"put into {partition!r}: data has {n} rows, meta names {len(meta)}")
    if target is not None:
        return names, [(target, {"partition": partition, "rows": ids_to_wire(meta.rows),
                                 "columns": {k: column_to_wire(c) for k, c in cols.items()}})]
    by_unit = _positions_by_unit(meta.rows)
    calls: list[_UnitCall] = []
    for u, pos in by_unit.items():
        part = cols if len(by_unit) == 1 else {k: c.take(pos) for k, c in cols.items()}
        calls.append((u, {"partition": partition, "rows": ids_to_wire([meta.rows[i] for i in pos]),
                          "columns": {k: column_to_wire(c) for k, c in part.items()}}))
    return names, calls


@charged("tq_client")
def _put_check(meta: BatchMeta | None, calls: list[_UnitCall]) -> dict[str, Any] | None:
    """The controller's ``check_put`` args for a put that adds columns to rows of several
    units, else None. Each unit validates and rolls back only its own part, so such a put is
    checked whole first: a part refused later would leave the other parts stored. A put to
    one unit skips this round trip (the hot path): that unit's notify validates it whole."""
    if meta is None or len(calls) < 2:
        return None
    wire = calls[0][1]["columns"]
    return {"partition": meta.partition, "rows": ids_to_wire(meta.rows),
            "columns": {k: column_from_wire(w).schema.to_wire() for k, w in wire.items()}}


def _task_list(partition: str, tasks: Sequence[str]) -> list[str]:
    if isinstance(tasks, str):  # list("train") would declare the tasks 't', 'r', 'a', ...
        raise ValueError(f"create_partition {partition!r}: tasks must be a list of names, got the string "
                         f"{tasks!r}; write tasks=[{tasks!r}]")
    return list(tasks)


def _get_names(meta: BatchMeta, columns: Sequence[str] | None) -> list[str]:
    names = list(meta.columns if columns is None else columns)
    if not meta.rows:
        raise BadPutError(f"get_data of an empty batch of partition {meta.partition!r}")
    if not names:
        raise BadPutError(f"get_data of no columns from partition {meta.partition!r}")
    return names


def _unlocated(meta: BatchMeta, names: list[str], n_units: int) -> list[str]:
    """Columns whose place the meta cannot tell: not its own columns (a get_meta names where
    those are) and possibly written off-home, which only happens with several units."""
    if n_units <= 1:
        return []
    return [c for c in names if c not in meta.locations and c not in meta.columns]


@charged("tq_client")
def _assemble(names: list[str], requests: list[_Request], replies: list[dict[str, Any]]) -> dict[str, Column]:
    """Unit replies -> columns in the meta's row order."""
    if len(replies) == 1:
        return {k: column_from_wire(replies[0][k]) for k in names}
    out = {}
    for k in names:
        parts = [(pos, reply[k]) for (_, pos, cols), reply in zip(requests, replies) if k in cols]
        if len(parts) == 1:
            out[k] = column_from_wire(parts[0][1])
            continue
        order = [i for pos, _ in parts for i in pos]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        out[k] = concat([column_from_wire(w) for _, w in parts]).take(inverse.tolist())
    return out


def _batch_names(columns: Sequence[str], data_columns: Sequence[str] | None) -> list[str]:
    names = list(columns if data_columns is None else data_columns)
    if not names:
        raise BadPutError("get_batch of no data columns")
    return names


@charged("tq_client")
def _batch_reply(reply: dict[str, Any], names: list[str]) -> tuple[BatchMeta, dict[str, Column] | None]:
    """A get_batch reply -> (meta, its columns), columns None when the controller could not
    read them itself (a unit in another process): the caller reads as get_columns does."""
    meta = BatchMeta.from_wire(reply["meta"])
    reads = reply.get("reads")
    if reads is None or not meta.rows:
        return meta, None
    every = list(range(len(meta.rows)))
    requests = [(int(r["unit"]), every if r["pos"] is None else ids_from_wire(r["pos"]), list(r["cols"]))
                for r in reads]
    return meta, _assemble(names, requests, [r["data"] for r in reads])


def _unit_timeout(index: int, address: str, e: TransferQueueTimeout) -> TransferQueueTimeout:
    return TransferQueueTimeout(f"storage unit {index} ({address}) did not answer: its process (or its node's "
                                f"rank) may have died: {e}")


@charged("tq_client")
def _new_rows_meta(partition: str, names: list[str], groups: Any, reply: dict[str, Any]) -> BatchMeta:
    if "first" in reply:  # new rows have consecutive ids
        rows = list(range(reply["first"], reply["first"] + reply["n"]))
    else:
        rows = ids_from_wire(reply["rows"])
    return BatchMeta(partition, rows, names,
                     ids_from_wire(groups) if groups is not None else [], ids_from_wire(reply["tokens"]))


def _get_meta_args(columns: Sequence[str], batch_size: int, task: str, partition: str, sampler: SamplerSpec,
                   allow_partial: bool, timeout: float, dp_group: str | None, dp_rank: int,
                   dp_size: int, min_rows: int = 0) -> dict[str, Any]:
    args = {"partition": partition, "task": task, "columns": list(columns), "batch_size": batch_size,
            "sampler": sampler, "allow_partial": allow_partial, "timeout": timeout,
            "dp_group": dp_group, "dp_rank": dp_rank, "dp_size": dp_size}
    if min_rows:
        args["min_rows"] = min_rows
    return args


class _Units:
    """Which storage units exist, and which one takes the next put of new rows."""

    def __init__(self, preferred: int | None):
        self.preferred = preferred if preferred is not None else local_unit()
        self.addresses: dict[int, str] = {}
        self._rr = itertools.count()

    def update(self, info: dict[str, Any]) -> list[int]:
        new = [int(k) for k in info["units"] if int(k) not in self.addresses]
        self.addresses.update({int(k): a for k, a in info["units"].items()})
        return new

    def pick(self) -> int:
        if not self.addresses:
            raise TransferQueueError("the controller has no storage unit registered yet")
        if self.preferred is not None:
            if self.preferred not in self.addresses:
                raise TransferQueueError(f"preferred storage unit {self.preferred} is not registered "
                                         f"(known: {sorted(self.addresses)})")
            return self.preferred
        units = sorted(self.addresses)
        return units[next(self._rr) % len(units)]


# ---- async client (driver, event-loop code) -----------------------------------------------

class AsyncTransferQueueClient:
    """``preferred_unit``: where this client writes (default: its node's unit, else new rows
    spread over all units); ``node``: the writer's node, reported in unit stats (default:
    this process's node); ``direct``: call the controller and units that run in this process
    (a service on a thread of it, ``transfer_queue.service=driver``) without a socket or the
    codec's frames, as ``rpc.thread_endpoint`` does (the same copies, refusals and errors as
    over the wire); False: every call over a socket."""

    def __init__(self, controller_address: str, *, timeout: float = 60.0, wait_timeout: float = 300.0,
                 preferred_unit: int | None = None, node: int | None = None,
                 ctx: zmq.asyncio.Context | None = None, direct: bool = True):
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.direct = direct
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self.controller = self._endpoint(controller_address)
        self._units = _Units(preferred_unit)
        self.node = node if node is not None else local_node()
        self._endpoints: dict[int, RpcClient | ThreadEndpoint] = {}

    def _endpoint(self, address: str) -> RpcClient | ThreadEndpoint:
        """A service of this process is called directly (thread_endpoint), any other over a socket."""
        here = in_process(address, self.timeout, timeout_error=TransferQueueTimeout) if self.direct else None
        return here or RpcClient(address, self._ctx, self.timeout, timeout_error=TransferQueueTimeout)

    async def _refresh_units(self) -> None:
        for i in self._units.update(await self.controller.call("info")):
            self._endpoints[i] = self._endpoint(self._units.addresses[i])

    async def _unit(self, index: int | None) -> RpcClient | ThreadEndpoint:
        if index is None:
            if not self._endpoints:
                await self._refresh_units()
            index = self._units.pick()
        if index not in self._endpoints:
            await self._refresh_units()
            if index not in self._endpoints:
                raise TransferQueueError(f"storage unit {index} is not registered with the controller "
                                         f"(known: {sorted(self._endpoints)})")
        return self._endpoints[index]

    async def _call_unit(self, index: int, ep: RpcClient | ThreadEndpoint, method: str, /, **args: Any) -> Any:
        try:
            return await ep.call(method, **args)
        except TransferQueueTimeout as e:
            raise _unit_timeout(index, ep.address, e) from None

    async def _located(self, meta: BatchMeta, names: list[str]) -> BatchMeta:
        if not self._endpoints:
            await self._refresh_units()
        ask = _unlocated(meta, names, len(self._units.addresses))
        if not ask:
            return meta
        got = await self.controller.call("locate", partition=meta.partition, rows=ids_to_wire(meta.rows),
                                         columns=ask)
        return replace(meta, locations={**meta.locations, **{c: ids_from_wire(u) for c, u in got.items()}})

    async def create_partition(self, partition: str, tasks: Sequence[str] = (), *,
                               close_at: int | None = None) -> None:
        """``close_at``: the partition closes itself once it holds that many rows."""
        await self.controller.call("create_partition", partition=partition, tasks=_task_list(partition, tasks),
                                   close_at=close_at)

    async def close_partition(self, partition: str) -> None:
        """End of stream: consumers drain what is left, then get an empty meta with end_of_stream."""
        await self.controller.call("close_partition", partition=partition)

    async def clear(self, partition: str) -> int:
        return int(await self.controller.call("clear", partition=partition))

    async def clear_then_stats(self, partition: str) -> tuple[int, list[dict[str, Any]]]:
        """``clear``, then what ``unit_stats`` returns, in one request: (rows freed, stats)."""
        reply = await self.controller.call("clear_then_stats", partition=partition)
        return int(reply["rows"]), list(reply["units"])

    async def clear_rows(self, meta: BatchMeta) -> int:
        return int(await self.controller.call("clear_rows", partition=meta.partition, rows=ids_to_wire(meta.rows)))

    async def reset_consumption(self, partition: str, task: str) -> None:
        await self.controller.call("reset_consumption", partition=partition, task=task)

    async def status(self, partition: str | None = None) -> dict[str, Any]:
        reply: dict[str, Any] = await self.controller.call("status", partition=partition)
        return reply

    async def unit_stats(self) -> list[dict[str, Any]]:
        """Every storage unit's stats, in unit order (gathered by the controller: one request)."""
        reply: list[dict[str, Any]] = await self.controller.call("unit_stats")
        return reply

    async def put(self, data: Any, partition: str, meta: BatchMeta | None = None, *,
                  groups: Sequence[int] | None = None, timeout: float | None = None,
                  create: NewPartition | None = None) -> BatchMeta:
        """Write ``data`` (a TensorDict or a dict of columns). Without ``meta`` the rows are new;
        with ``meta`` the columns are added to the rows it names, in its row order. ``create``
        (new rows only): the partition is created with them, in the same request."""
        target = None
        if meta is not None and self._units.preferred is not None:
            target = self._units.preferred
        names, calls = _plan_put(data, partition, meta, groups, target, create)
        wait = self.wait_timeout if timeout is None else timeout
        check = _put_check(meta, calls)
        if check is not None:
            await self.controller.call("check_put", **check)
        if not self._endpoints:
            await self._refresh_units()
        idx = [self._units.pick() if u is None else u for u, _ in calls]
        eps = [await self._unit(i) for i in idx]
        res = await asyncio.gather(*(self._call_unit(i, ep, "put", _timeout=wait + _REPLY_MARGIN_S, timeout=wait,
                                                     node=self.node, **args)
                                     for i, ep, (_, args) in zip(idx, eps, calls)))
        if meta is None:
            return _new_rows_meta(partition, names, calls[0][1]["groups"], res[0])
        out = meta.with_columns(names)
        return out.stored_at(names, target) if target is not None else out


    async def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                       sampler: SamplerSpec = "sequential", *, allow_partial: bool = False,
                       timeout: float | None = None, dp_group: str | None = None, dp_rank: int = 0,
                       dp_size: int = 1, min_rows: int = 0) -> BatchMeta:
        """Rows whose ``columns`` are all written and that ``task`` has not consumed; marks them
        consumed. Waits up to ``timeout`` for ``batch_size`` rows (``allow_partial``: return what
        is ready; ``min_rows``: go once that many are ready, with every ready row up to
        ``batch_size``). An empty meta with ``end_of_stream`` means the closed partition is drained."""
        wait = self.wait_timeout if timeout is None else timeout
        args = _get_meta_args(columns, batch_size, task, partition, sampler, allow_partial, wait,
                              dp_group, dp_rank, dp_size, min_rows)
        return BatchMeta.from_wire(await self.controller.call("get_meta", _timeout=wait + _REPLY_MARGIN_S,
                                                              **args))

    async def get_batch(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                        sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                        allow_partial: bool = False, timeout: float | None = None, dp_group: str | None = None,
                        dp_rank: int = 0, dp_size: int = 1) -> tuple[BatchMeta, TensorDict | None]:
        """``get_meta`` then ``get_data`` of its rows (``data_columns``, default ``columns``), in
        one hop when the controller's process holds those rows (the in-process default), else
        two. Same consumption as get_meta. Returns ``(meta, TensorDict)``; the data is None
        for an empty meta (end of stream, or nothing ready with ``allow_partial``)."""
        meta, cols = await self.get_batch_columns(columns, batch_size, task, partition, sampler,
                                                  data_columns=data_columns, allow_partial=allow_partial,
                                                  timeout=timeout, dp_group=dp_group, dp_rank=dp_rank,
                                                  dp_size=dp_size)
        return meta, None if cols is None else to_tensordict(cols, len(meta))

    async def get_batch_columns(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                                sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                                allow_partial: bool = False, timeout: float | None = None,
                                dp_group: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                                min_rows: int = 0) -> tuple[BatchMeta, dict[str, Column] | None]:
        """``get_batch`` with the data as get_columns gives it (a Column per name), for readers
        that want the columns themselves (the driver's stage functions); ``min_rows`` as in get_meta."""
        names = _batch_names(columns, data_columns)
        wait = self.wait_timeout if timeout is None else timeout
        args = _get_meta_args(columns, batch_size, task, partition, sampler, allow_partial, wait,
                              dp_group, dp_rank, dp_size, min_rows)
        reply = await self.controller.call("get_batch", _timeout=wait + _REPLY_MARGIN_S, data_columns=names, **args)
        meta, cols = _batch_reply(reply, names)
        if not meta.rows:
            return meta, None
        if cols is None:
            cols = await self.get_columns(meta, names)
        return meta, cols

    async def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]:
        """The requested columns of the meta's rows, in the meta's row order."""
        names = _get_names(meta, columns)
        meta = await self._located(meta, names)
        requests = _plan_get(meta, names)
        eps = [await self._unit(u) for u, _, _ in requests]
        replies = await asyncio.gather(*(
            self._call_unit(u, ep, "get", partition=meta.partition, rows=ids_to_wire([meta.rows[i] for i in pos]),
                            columns=cols)
            for ep, (u, pos, cols) in zip(eps, requests)))
        return _assemble(names, requests, list(replies))

    async def get_data(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> TensorDict:
        """A TensorDict of the meta's rows (in its order) with only the requested columns.
        Tensors may share memory with the received message: clone before writing in place."""
        return to_tensordict(await self.get_columns(meta, columns), len(meta))

    async def close(self) -> None:
        await self.controller.close()
        for u in self._endpoints.values():
            await u.close()
        self._endpoints.clear()


# ---- blocking client (worker code) --------------------------------------------------------

class TransferQueueClient:
    """The same API as :class:`AsyncTransferQueueClient`, blocking, for worker code.

    Safe to share between threads (each thread gets its own sockets); every call has a
    timeout, so nothing blocks forever.
    """

    def __init__(self, controller_address: str, *, timeout: float = 60.0, wait_timeout: float = 300.0,
                 preferred_unit: int | None = None, node: int | None = None,
                 ctx: zmq.Context[Any] | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self.controller = BlockingRpcClient(controller_address, self._ctx, timeout, timeout_error=TransferQueueTimeout)
        self._units = _Units(preferred_unit)
        self.node = node if node is not None else local_node()
        self._endpoints: dict[int, BlockingRpcClient] = {}
        self._lock = threading.Lock()

    def _refresh_units(self) -> None:
        info = self.controller.call("info")
        with self._lock:
            for i in self._units.update(info):
                self._endpoints[i] = BlockingRpcClient(self._units.addresses[i], self._ctx, self.timeout,
                                                       timeout_error=TransferQueueTimeout)

    def _unit(self, index: int | None) -> BlockingRpcClient:
        if index is None:
            if not self._endpoints:
                self._refresh_units()
            index = self._units.pick()
        if index not in self._endpoints:
            self._refresh_units()
            if index not in self._endpoints:
                raise TransferQueueError(f"storage unit {index} is not registered with the controller "
                                         f"(known: {sorted(self._endpoints)})")
        return self._endpoints[index]

    def _recv_unit(self, index: int, ep: BlockingRpcClient, ticket: Any, timeout: float | None = None) -> Any:
        try:
            return ep.recv(ticket, timeout)
        except TransferQueueTimeout as e:
            raise _unit_timeout(index, ep.address, e) from None

    def _located(self, meta: BatchMeta, names: list[str]) -> BatchMeta:
        if not self._endpoints:
            self._refresh_units()
        ask = _unlocated(meta, names, len(self._units.addresses))
        if not ask:
            return meta
        got = self.controller.call("locate", partition=meta.partition, rows=ids_to_wire(meta.rows), columns=ask)
        return replace(meta, locations={**meta.locations, **{c: ids_from_wire(u) for c, u in got.items()}})

    @charged("tq_client")
    def create_partition(self, partition: str, tasks: Sequence[str] = (), *, close_at: int | None = None) -> None:
        self.controller.call("create_partition", partition=partition, tasks=_task_list(partition, tasks),
                             close_at=close_at)

    @charged("tq_client")
    def close_partition(self, partition: str) -> None:
        self.controller.call("close_partition", partition=partition)

    @charged("tq_client")
    def clear(self, partition: str) -> int:
        return int(self.controller.call("clear", partition=partition))

    @charged("tq_client")
    def clear_rows(self, meta: BatchMeta) -> int:
        return int(self.controller.call("clear_rows", partition=meta.partition, rows=ids_to_wire(meta.rows)))

    @charged("tq_client")
    def reset_consumption(self, partition: str, task: str) -> None:
        self.controller.call("reset_consumption", partition=partition, task=task)

    @charged("tq_client")
    def status(self, partition: str | None = None) -> dict[str, Any]:
        reply: dict[str, Any] = self.controller.call("status", partition=partition)
        return reply

    def unit_stats(self) -> list[dict[str, Any]]:
        """Every storage unit's stats, in unit order (gathered by the controller: one request)."""
        reply: list[dict[str, Any]] = self.controller.call("unit_stats")
        return reply

    @charged("tq_client")
    def put(self, data: Any, partition: str, meta: BatchMeta | None = None, *,
            groups: Sequence[int] | None = None, timeout: float | None = None,
            create: NewPartition | None = None) -> BatchMeta:
        target = self._units.preferred if meta is not None else None
        names, calls = _plan_put(data, partition, meta, groups, target, create)
        wait = self.wait_timeout if timeout is None else timeout
        check = _put_check(meta, calls)
        if check is not None:
            self.controller.call("check_put", **check)
        sent = []
        if not self._endpoints:
            self._refresh_units()
        for u, args in calls:
            u = self._units.pick() if u is None else u
            ep = self._unit(u)
            sent.append((u, ep, ep.send("put", timeout=wait, node=self.node, **args)))
        res = [self._recv_unit(u, ep, ticket, wait + _REPLY_MARGIN_S) for u, ep, ticket in sent]
        if meta is None:
            return _new_rows_meta(partition, names, calls[0][1]["groups"], res[0])
        out = meta.with_columns(names)
        return out.stored_at(names, target) if target is not None else out

    @charged("tq_client")
    def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                 sampler: SamplerSpec = "sequential", *, allow_partial: bool = False, timeout: float | None = None,
                 dp_group: str | None = None, dp_rank: int = 0, dp_size: int = 1) -> BatchMeta:
        wait = self.wait_timeout if timeout is None else timeout
        args = _get_meta_args(columns, batch_size, task, partition, sampler, allow_partial, wait,
                              dp_group, dp_rank, dp_size)
        return BatchMeta.from_wire(self.controller.call("get_meta", _timeout=wait + _REPLY_MARGIN_S, **args))

    @charged("tq_client")
    def get_batch(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                  sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                  allow_partial: bool = False, timeout: float | None = None, dp_group: str | None = None,
                  dp_rank: int = 0, dp_size: int = 1) -> tuple[BatchMeta, TensorDict | None]:
        meta, cols = self.get_batch_columns(columns, batch_size, task, partition, sampler, data_columns=data_columns,
                                            allow_partial=allow_partial, timeout=timeout, dp_group=dp_group,
                                            dp_rank=dp_rank, dp_size=dp_size)
        return meta, None if cols is None else to_tensordict(cols, len(meta))

    @charged("tq_client")
    def get_batch_columns(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                          sampler: Any = "sequential", *, data_columns: Sequence[str] | None = None,
                          allow_partial: bool = False, timeout: float | None = None, dp_group: str | None = None,
                          dp_rank: int = 0, dp_size: int = 1) -> tuple[BatchMeta, dict[str, Column] | None]:
        """``get_batch`` with the data as get_columns gives it (a Column per name); None for an
        empty meta."""
        names = _batch_names(columns, data_columns)
        wait = self.wait_timeout if timeout is None else timeout
        args = _get_meta_args(columns, batch_size, task, partition, sampler, allow_partial, wait,
                              dp_group, dp_rank, dp_size)
        reply = self.controller.call("get_batch", _timeout=wait + _REPLY_MARGIN_S, data_columns=names, **args)
        meta, cols = _batch_reply(reply, names)
        if not meta.rows:
            return meta, None
        if cols is None:
            cols = self.get_columns(meta, names)
        return meta, cols

    @charged("tq_client")
    def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]:
        names = _get_names(meta, columns)
        meta = self._located(meta, names)
        requests = _plan_get(meta, names)
        sent = []
        for u, pos, cols in requests:
            ep = self._unit(u)
            sent.append((u, ep, ep.send("get", partition=meta.partition,
                                        rows=ids_to_wire([meta.rows[i] for i in pos]), columns=cols)))
        return _assemble(names, requests, [self._recv_unit(u, ep, t) for u, ep, t in sent])

    @charged("tq_client")
    def get_data(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> TensorDict:
        return to_tensordict(self.get_columns(meta, columns), len(meta))

    def close(self) -> None:
        self.controller.close()
        for u in self._endpoints.values():
            u.close()
        self._endpoints.clear()

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
