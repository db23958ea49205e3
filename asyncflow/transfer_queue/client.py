"""Clients of the TransferQueue: an async one, and a sync wrapper for worker code.

The client talks to the controller for metadata and straight to the storage units
for bytes, over persistent connections. Reads are routed by row id (the unit is in
the id's high bits), so fetching data never asks the controller.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, Coroutine, Sequence, TypeVar

import torch
import zmq.asyncio

from .columns import Column, column_from_wire, column_to_wire, concat, to_columns, to_tensordict
from .errors import BadPutError, TransferQueueError
from .meta import BatchMeta, unit_of
from .transport import RpcClient

T = TypeVar("T")

# Added to a server-side wait so the reply (or its error) can arrive before the client gives up.
_REPLY_MARGIN_S = 10.0


class AsyncTransferQueueClient:
    def __init__(self, controller_address: str, *, timeout: float = 60.0, wait_timeout: float = 300.0,
                 preferred_unit: int | None = None, ctx: zmq.asyncio.Context | None = None):
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self.preferred_unit = preferred_unit
        self.controller = RpcClient(controller_address, self._ctx, timeout)
        self._units: dict[int, RpcClient] = {}
        self._unit_addresses: dict[int, str] = {}
        self._rr = itertools.count()

    # ---- connection -----------------------------------------------------------------------

    async def _refresh_units(self) -> None:
        info = await self.controller.call("info")
        for k, addr in info["units"].items():
            i = int(k)
            if i not in self._units:
                self._units[i] = RpcClient(addr, self._ctx, self.timeout)
                self._unit_addresses[i] = addr

    async def _unit(self, index: int) -> RpcClient:
        if index not in self._units:
            await self._refresh_units()
            if index not in self._units:
                raise TransferQueueError(f"storage unit {index} is not registered with the controller "
                                         f"(known: {sorted(self._units)})")
        return self._units[index]

    async def _pick_unit(self) -> int:
        if not self._units:
            await self._refresh_units()
            if not self._units:
                raise TransferQueueError("the controller has no storage unit registered yet")
        if self.preferred_unit is not None:
            return self.preferred_unit
        units = sorted(self._units)
        return units[next(self._rr) % len(units)]

    # ---- partitions ---------------------------------------------------------------------

    async def create_partition(self, partition: str, tasks: Sequence[str] = ()) -> None:
        await self.controller.call("create_partition", partition=partition, tasks=list(tasks))

    async def close_partition(self, partition: str) -> None:
        """End of stream: consumers drain what is left, then get an empty meta with end_of_stream."""
        await self.controller.call("close_partition", partition=partition)

    async def clear(self, partition: str) -> int:
        return await self.controller.call("clear", partition=partition)

    async def clear_rows(self, meta: BatchMeta) -> int:
        return await self.controller.call("clear_rows", partition=meta.partition, rows=meta.rows)

    async def reset_consumption(self, partition: str, task: str) -> None:
        await self.controller.call("reset_consumption", partition=partition, task=task)

    async def status(self, partition: str | None = None) -> dict:
        return await self.controller.call("status", partition=partition)

    async def unit_stats(self) -> list[dict]:
        await self._refresh_units()
        return list(await asyncio.gather(*(u.call("stats") for u in self._units.values())))

    # ---- data ---------------------------------------------------------------------------

    async def put(self, data: Any, partition: str, meta: BatchMeta | None = None, *,
                  groups: Sequence[int] | None = None, timeout: float | None = None) -> BatchMeta:
        """Write ``data`` (a TensorDict or a dict of columns). Without ``meta``, the rows are new;
        with ``meta``, the columns are added to the rows it names (in its row order)."""
        cols, n = to_columns(data)
        wire = {k: column_to_wire(c) for k, c in cols.items()}
        wait = self.wait_timeout if timeout is None else timeout
        if meta is None:
            if groups is not None:
                groups = [int(g) for g in groups]
                if len(groups) != n:
                    raise BadPutError(f"put into {partition!r}: {len(groups)} group ids for {n} rows")
            unit = await self._pick_unit()
            res = await (await self._unit(unit)).call(
                "put", _timeout=wait + _REPLY_MARGIN_S, partition=partition, columns=wire,
                groups=groups, timeout=wait)
            return BatchMeta(partition, res["rows"], list(cols), list(groups or []), res["tokens"])
        if groups is not None:
            raise BadPutError("groups are set when rows are created; this put adds columns to existing rows")
        if meta.partition != partition:
            raise BadPutError(f"meta is of partition {meta.partition!r}, put targets {partition!r}")
        if len(meta) != n:
            raise BadPutError(f"put into {partition!r}: data has {n} rows, meta names {len(meta)}")
        by_unit = _positions_by_unit(meta.rows)
        if len(by_unit) == 1:
            calls = [((await self._unit(next(iter(by_unit)))), meta.rows, wire)]
        else:
            calls = []
            for u, pos in by_unit.items():
                part = {k: column_to_wire(c.take(pos)) for k, c in cols.items()}
                calls.append((await self._unit(u), [meta.rows[i] for i in pos], part))
        await asyncio.gather(*(ep.call("put", _timeout=wait + _REPLY_MARGIN_S, partition=partition,
                                       columns=w, rows=rows, timeout=wait) for ep, rows, w in calls))
        return meta.with_columns(list(cols))

    async def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                       sampler: Any = "sequential", *, allow_partial: bool = False,
                       timeout: float | None = None, dp_group: str | None = None, dp_rank: int = 0,
                       dp_size: int = 1) -> BatchMeta:
        """Rows whose ``columns`` are all written and that ``task`` has not consumed; marks them
        consumed. Waits up to ``timeout`` for ``batch_size`` rows (``allow_partial``: return what
        is ready). An empty meta with ``end_of_stream`` means the closed partition is drained."""
        wait = self.wait_timeout if timeout is None else timeout
        w = await self.controller.call(
            "get_meta", _timeout=wait + _REPLY_MARGIN_S, partition=partition, task=task,
            columns=list(columns), batch_size=batch_size, sampler=sampler, allow_partial=allow_partial,
            timeout=wait, dp_group=dp_group, dp_rank=dp_rank, dp_size=dp_size)
        return BatchMeta.from_wire(w)

    async def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]:
        """The requested columns of the meta's rows, in the meta's row order."""
        names = list(meta.columns if columns is None else columns)
        if not meta.rows:
            raise BadPutError(f"get_data of an empty batch of partition {meta.partition!r}")
        by_unit = _positions_by_unit(meta.rows)
        units = list(by_unit)
        endpoints = [await self._unit(u) for u in units]
        replies = await asyncio.gather(*(
            ep.call("get", partition=meta.partition, rows=[meta.rows[i] for i in by_unit[u]], columns=names)
            for u, ep in zip(units, endpoints)))
        if len(units) == 1:
            return {k: column_from_wire(replies[0][k]) for k in names}
        order = [i for u in units for i in by_unit[u]]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        inv = inverse.tolist()
        return {k: concat([column_from_wire(r[k]) for r in replies]).take(inv) for k in names}

    async def get_data(self, meta: BatchMeta, columns: Sequence[str] | None = None):
        """A TensorDict of the meta's rows (in its order) with only the requested columns.
        Tensors may share memory with the received message: clone before writing in place."""
        cols = await self.get_columns(meta, columns)
        return to_tensordict(cols, len(meta))

    async def close(self) -> None:
        await self.controller.close()
        for u in self._units.values():
            await u.close()
        self._units.clear()


def _positions_by_unit(rows: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        out.setdefault(unit_of(r), []).append(i)
    return out


class EventLoopThread:
    """An asyncio loop on a daemon thread, for sync code that needs async services."""

    def __init__(self, name: str = "asyncflow-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


class TransferQueueClient:
    """Blocking facade over :class:`AsyncTransferQueueClient` for worker code.

    It runs its own event loop on a background thread; every call has the async
    client's timeouts, so nothing blocks forever.
    """

    def __init__(self, controller_address: str, **kwargs: Any):
        self._loop = EventLoopThread("tq-client")
        self._client = self._loop.run(self._make(controller_address, kwargs))

    @staticmethod
    async def _make(address: str, kwargs: dict) -> AsyncTransferQueueClient:
        return AsyncTransferQueueClient(address, ctx=zmq.asyncio.Context(), **kwargs)

    def put(self, data: Any, partition: str, meta: BatchMeta | None = None, **kw: Any) -> BatchMeta:
        return self._loop.run(self._client.put(data, partition, meta, **kw))

    def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                 sampler: Any = "sequential", **kw: Any) -> BatchMeta:
        return self._loop.run(self._client.get_meta(columns, batch_size, task, partition, sampler, **kw))

    def get_data(self, meta: BatchMeta, columns: Sequence[str] | None = None):
        return self._loop.run(self._client.get_data(meta, columns))

    def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]:
        return self._loop.run(self._client.get_columns(meta, columns))

    def create_partition(self, partition: str, tasks: Sequence[str] = ()) -> None:
        self._loop.run(self._client.create_partition(partition, tasks))

    def close_partition(self, partition: str) -> None:
        self._loop.run(self._client.close_partition(partition))

    def clear(self, partition: str) -> int:
        return self._loop.run(self._client.clear(partition))

    def clear_rows(self, meta: BatchMeta) -> int:
        return self._loop.run(self._client.clear_rows(meta))

    def reset_consumption(self, partition: str, task: str) -> None:
        self._loop.run(self._client.reset_consumption(partition, task))

    def status(self, partition: str | None = None) -> dict:
        return self._loop.run(self._client.status(partition))

    def unit_stats(self) -> list[dict]:
        return self._loop.run(self._client.unit_stats())

    def close(self) -> None:
        try:
            self._loop.run(self._client.close(), timeout=10)
        finally:
            self._loop.stop()

    def __enter__(self) -> "TransferQueueClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
