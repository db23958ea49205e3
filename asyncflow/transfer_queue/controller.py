"""The TransferQueue controller: metadata only, never data bytes.

Per partition it knows which rows exist, which columns each row has (a bitmask per
row), each column's schema, and, per consumer task, which rows the task consumed.
Readiness is kept incrementally: a *subscription* (task, column set) holds the rows
that have all its columns and that the task has not consumed, in the order they
became ready. A write updates only the subscriptions that read the written columns,
for the written rows; a request looks only at its subscription. Waiting requests
sleep on an event that writes set: no polling.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any, overload

import zmq.asyncio

from ..rpc.async_client import RpcClient
from ..rpc.local_endpoint import LocalEndpoint
from ..rpc.waits import wait_within
from .columns import FieldSchema
from .errors import (
    BadPutError,
    RowsClearedError,
    SchemaMismatchError,
    TransferQueueTimeout,
    UnknownPartitionError,
    UnknownTaskError,
)
from .meta import BatchMeta, ids_from_wire, ids_to_wire, plan_reads, unit_of
from .recent import RecentSet
from .samplers import ReadyRows, Sampler, SamplerSpec, build_sampler


@dataclass
class _Subscription:
    task: str
    columns: tuple[str, ...]
    mask: int
    # Rows with all the columns that the task has not consumed, in the order they became ready;
    # changed only through its add / remove (they keep grouped samplers' indexes in step).
    ready: ReadyRows = field(default_factory=ReadyRows)


@dataclass
class _DPShare:
    """Batches handed to one data-parallel group: every member gets the same ones."""
    size: int
    base: int = 0  # sequence number of batches[0]
    batches: list[tuple[dict[str, Any], set[int]]] = field(default_factory=list)  # (meta_wire, ranks that took it)
    next_seq: dict[int, int] = field(default_factory=dict)


class _Partition:
    def __init__(self, name: str):
        self.name = name
        self.schema: dict[str, FieldSchema] = {}
        self.bit: dict[str, int] = {}
        self.rows: dict[int, int] = {}  # row -> mask of produced columns
        self.groups: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.consumed: dict[str, set[int]] = {}
        # Consumer tasks declared by create_partition; when any are, only they are served
        # (a typo'd task name would otherwise start a new consumer and take rows silently).
        self.tasks: set[str] = set()
        self.subs: dict[str, dict[tuple[str, ...], _Subscription]] = {}
        self.subs_by_column: dict[str, list[_Subscription]] = {}
        self.dp_shares: dict[tuple[str, str], _DPShare] = {}
        # column -> {row: unit} for cells stored off the row's home unit (a producer on another node)
        self.where: dict[str, dict[int, int]] = {}
        self.closed = False
        # create_partition(close_at=n): the partition closes itself once it holds n rows (a
        # producer that knows its row count saves the close_partition round trip)
        self.close_at: int | None = None
        self.cleared = False
        self.changed = asyncio.Event()
        self.created = time.time()

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def mask_of(self, columns: Sequence[str]) -> int | None:
        m = 0
        for c in columns:
            b = self.bit.get(c)
            if b is None:
                return None
            m |= 1 << b
        return m

    def mask_giving_bits(self, columns: Sequence[str]) -> int:
        """The mask of ``columns``; a column nobody wrote yet gets its bit now, so the mask is stable."""
        m = 0
        for c in columns:
            b = self.bit.get(c)
            if b is None:
                b = self.bit[c] = len(self.bit)
            m |= 1 << b
        return m


class Controller:
    """Metadata service. Methods prefixed ``rpc_`` are what clients call (locally or over ZMQ)."""

    def __init__(self, default_timeout: float = 300.0):
        self.partitions: dict[str, _Partition] = {}
        self.cleared = RecentSet()
        self.tasks: set[str] = set()
        self.units: dict[int, RpcClient | LocalEndpoint] = {}  # unit index -> endpoint
        self.unit_addresses: dict[int, str] = {}
        self.default_timeout = default_timeout
        self._samplers: dict[str, Sampler] = {}
        self.stats = {"get_meta": 0, "notify": 0, "rows_ready": 0}

    # ---- lookup ---------------------------------------------------------------------

    def _partition(self, name: str) -> _Partition:
        p = self.partitions.get(name)
        if p is not None:
            return p
        if name in self.cleared:
            raise RowsClearedError(f"partition {name!r} was cleared; create it again to reuse the name")
        known = sorted(self.partitions)
        raise UnknownPartitionError(
            f"unknown partition {name!r}; create it first with create_partition "
            f"(known: {known[:10]}{' ...' if len(known) > 10 else ''})")

    def _sampler(self, spec: SamplerSpec) -> Sampler:
        key = json.dumps(spec, sort_keys=True)
        s = self._samplers.get(key)
        if s is None:
            s = self._samplers[key] = build_sampler(spec)
        return s

    # ---- storage units ---------------------------------------------------------------

    def attach_unit(self, index: int, endpoint: RpcClient | LocalEndpoint, address: str) -> None:
        self.units[index] = endpoint
        self.unit_addresses[index] = address

    async def rpc_register_unit(self, index: int, address: str) -> dict[str, Any]:
        if index in self.units and self.unit_addresses.get(index) != address:
            raise ValueError(f"storage unit {index} is already registered at {self.unit_addresses[index]}")
        if index not in self.units:  # a unit in another process: reach it over ZMQ
            self.attach_unit(index, RpcClient(address, self._zmq_ctx(), timeout_error=TransferQueueTimeout), address)
        return await self.rpc_info()

    def _zmq_ctx(self) -> zmq.asyncio.Context:
        return zmq.asyncio.Context.instance()

    async def _unit_call(self, index: int, method: str, **args: Any) -> Any:
        try:
            return await self.units[index].call(method, **args)
        except TransferQueueTimeout as e:  # name the unit: its process (a node's rank) may be gone
            raise TransferQueueTimeout(f"storage unit {index} ({self.unit_addresses.get(index)}) did not answer "
                                       f"{method}: {e}") from None

    async def rpc_info(self) -> dict[str, Any]:
        return {"units": {str(i): a for i, a in sorted(self.unit_addresses.items())}}

    async def rpc_unit_stats(self) -> list[dict[str, Any]]:
        """Every storage unit's stats (``StorageUnit.rpc_stats``), in unit order: one request for
        a client (asked every step), the units beside the controller answering in process."""
        return list(await asyncio.gather(*(self._unit_call(i, "stats") for i in sorted(self.units))))

    # ---- partitions -------------------------------------------------------------------

    async def rpc_create_partition(self, partition: str, tasks: Sequence[str] = (),
                                   close_at: int | None = None) -> None:
        """A new partition (or more tasks for an existing one). ``close_at``: it closes itself
        once it holds that many rows, as if close_partition were called then."""
        if not isinstance(partition, str) or not partition:
            raise ValueError(f"partition name must be a non-empty string, got {partition!r}")
        if isinstance(tasks, str) or not all(isinstance(t, str) and t for t in tasks):
            raise ValueError(f"create_partition {partition!r}: tasks must be a list of non-empty strings, "
                             f"got {tasks!r}")
        if close_at is not None and (isinstance(close_at, bool) or not isinstance(close_at, int) or close_at < 1):
            raise ValueError(f"create_partition {partition!r}: close_at must be a row count >= 1 (or None: "
                             f"close it with close_partition), got {close_at!r}")
        p = self.partitions.get(partition)
        if p is not None and close_at is not None and len(p.rows) >= close_at:
            raise ValueError(f"create_partition {partition!r}: close_at={close_at}, but it already holds "
                             f"{len(p.rows)} rows; give a larger count or call close_partition")
        if p is None:
            p = self.partitions[partition] = _Partition(partition)
            self.cleared.discard(partition)
        p.tasks.update(tasks)  # calling again declares more tasks
        if close_at is not None:
            p.close_at = close_at
        self.tasks.update(tasks)

    @staticmethod
    def _check_task(p: _Partition, task: str) -> None:
        """A partition created with tasks serves only those; one created without serves any."""
        if p.tasks and task not in p.tasks:
            raise UnknownTaskError(
                f"unknown task {task!r} for partition {p.name!r}: it serves only the tasks declared for it, "
                f"{sorted(p.tasks)}; fix the task name, or declare it with "
                f"create_partition({p.name!r}, tasks=[{task!r}])")

    async def rpc_close_partition(self, partition: str) -> None:
        """End of stream: no new rows will come (columns of existing rows still may)."""
        p = self._partition(partition)
        p.closed = True
        p.wake()

    async def rpc_clear(self, partition: str) -> int:
        """Forget the partition and free its bytes in every unit. Returns rows freed."""
        p = self._partition(partition)
        n = len(p.rows)
        del self.partitions[partition]
        self.cleared.add(partition)
        p.cleared = True
        p.wake()
        await asyncio.gather(*(self._unit_call(u, "drop_partition", partition=partition) for u in self.units))
        return n

    async def rpc_clear_then_stats(self, partition: str) -> dict[str, Any]:
        """``clear``, then every unit's stats: a driver that checks after each step that nothing
        is left behind asks once, not twice."""
        rows = await self.rpc_clear(partition)
        return {"rows": rows, "units": await self.rpc_unit_stats()}

    async def rpc_clear_rows(self, partition: str, rows: Any) -> int:
        p = self._partition(partition)
        rows = ids_from_wire(rows)
        gone = [r for r in rows if r in p.rows]
        for per_task in p.subs.values():  # first: a group index looks up the rows' groups
            for sub in per_task.values():
                sub.ready.remove(gone)
        for r in gone:
            del p.rows[r]
            p.groups.pop(r, None)
            p.tokens.pop(r, None)
        for consumed in p.consumed.values():
            consumed.difference_update(gone)
        by_unit: dict[int, set[int]] = {}
        for r in gone:
            by_unit.setdefault(unit_of(r), set()).add(r)
        for w in p.where.values():  # cells of these rows that producers stored on other units
            for r in gone:
                u = w.pop(r, None)
                if u is not None:
                    by_unit.setdefault(u, set()).add(r)
        await asyncio.gather(*(self._unit_call(u, "drop_rows", partition=partition, rows=sorted(rs))
                               for u, rs in by_unit.items() if u in self.units))
        p.wake()  # fewer pending rows may end a stream
        return len(gone)

    async def rpc_reset_consumption(self, partition: str, task: str) -> None:
        p = self._partition(partition)
        self._check_task(p, task)
        if task not in self.tasks:
            raise UnknownTaskError(f"unknown task {task!r}; known tasks: {sorted(self.tasks)}")
        p.consumed.pop(task, None)
        for sub in p.subs.pop(task, {}).values():
            for c in sub.columns:
                p.subs_by_column[c].remove(sub)
        p.dp_shares = {k: v for k, v in p.dp_shares.items() if k[0] != task}
        p.wake()

    async def rpc_status(self, partition: str | None = None) -> dict[str, Any]:
        if partition is None:
            return {"partitions": sorted(self.partitions), "tasks": sorted(self.tasks),
                    "units": len(self.units), "stats": dict(self.stats)}
        p = self._partition(partition)
        return {
            "partition": partition,
            "rows": len(p.rows),
            "closed": p.closed,
            "tasks": sorted(p.tasks),  # declared ones; empty: any task is served
            "columns": {c: s.to_wire() for c, s in p.schema.items()},
            "column_rows": {c: sum(1 for m in p.rows.values() if m >> b & 1) for c, b in p.bit.items()},
            "consumed": {t: len(s) for t, s in p.consumed.items()},
            "ready": {f"{s.task}:{','.join(s.columns)}": len(s.ready)
                      for per in p.subs.values() for s in per.values()},
        }

    # ---- writes (called by storage units after they stored the bytes) ------------------

    @staticmethod
    def _check_write(p: _Partition, rows: list[int], schemas: dict[str, FieldSchema], new_rows: bool,
                     groups: list[int] | None) -> None:
        """Raise if recording ``schemas`` for ``rows`` would be refused; changes nothing.
        The one validation of a write: rpc_notify runs it before applying, rpc_check_put
        before a multi-unit put sends any bytes."""
        for c, s in schemas.items():
            old = p.schema.get(c)
            if old is not None and old != s:
                raise SchemaMismatchError(
                    f"partition {p.name!r}, column {c!r}: holds {old.describe()} but this put sends "
                    f"{s.describe()}; convert the data or use another column name")
        if groups is not None and len(groups) != len(rows):
            raise BadPutError(f"partition {p.name!r}: {len(groups)} group ids for {len(rows)} rows")
        if new_rows:
            if p.closed:
                raise BadPutError(f"partition {p.name!r} is closed (end of stream): no new rows can be added")
            if p.close_at is not None and len(p.rows) + len(rows) > p.close_at:
                raise BadPutError(f"partition {p.name!r} was created for {p.close_at} rows (close_at) and holds "
                                  f"{len(p.rows)}: {len(rows)} new rows would exceed it; create it with the "
                                  "right count, or without close_at and call close_partition")
            if any(map(p.rows.__contains__, rows)):
                dup = [r for r in rows if r in p.rows]
                raise BadPutError(f"partition {p.name!r}: rows {dup[:5]} already exist")
            return
        if groups is not None:
            raise BadPutError("group ids are given when rows are created, not when columns are added")
        missing = [r for r in rows if r not in p.rows]
        if missing:
            raise RowsClearedError(f"partition {p.name!r}: rows {missing[:5]} do not exist (cleared, or never "
                                   f"created); put the columns of the other rows only")
        for c in schemas:
            b = p.bit.get(c)
            if b is not None:
                again = [r for r in rows if p.rows[r] >> b & 1]
                if again:
                    raise BadPutError(f"partition {p.name!r}: rows {again[:5]} already have column "
                                      f"{c!r}; columns are written once per row (leave those rows out, "
                                      f"or use another column name)")

    async def rpc_check_put(self, partition: str, rows: Any, columns: dict[str, Any]) -> None:
        """Refuse now a put of ``columns`` ({name: schema}) to existing ``rows`` that notify
        would refuse. A client calls it before a put split over several storage units: each
        unit rolls back only its own part, so without this check a part refused in one unit
        would leave the others' parts stored. Stores nothing. What it cannot rule out: a
        clear of these rows (or of the partition) between this check and the units' puts;
        the unit whose rows were cleared then refuses its part and the others keep theirs."""
        p = self._partition(partition)
        rows = ids_from_wire(rows)
        if len(set(rows)) != len(rows):  # a unit checks this only for its own part
            dup = sorted(r for r, n in Counter(rows).items() if n > 1)
            raise BadPutError(f"put into {partition!r} names rows {dup[:5]} more than once; name each row once")
        self._check_write(p, rows, {c: FieldSchema.from_wire(w) for c, w in columns.items()}, False, None)

    async def rpc_notify(self, partition: str, rows: Any, columns: dict[str, Any], new_rows: bool,
                         tokens: Any = None, groups: Any = None, unit: int | None = None,
                         create: dict[str, Any] | None = None) -> None:
        """Record that ``rows`` now have ``columns`` ({name: schema}), stored in ``unit``
        (None: the rows' home units). Validates everything before changing anything, so a
        rejected write leaves no trace. ``create`` (new rows only: a put that creates its
        partition, ``{"tasks": [...], "close_at": n}``): create_partition first, undone if the
        write is refused and the partition did not exist before."""
        existed, was_cleared = partition in self.partitions, partition in self.cleared
        if create is not None:
            await self._create_for_put(partition, create, new_rows)
        try:
            self._record(partition, rows, columns, new_rows, tokens, groups, unit)
        except BaseException:
            if create is not None and not existed:
                self.partitions.pop(partition, None)
                if was_cleared:  # reads keep saying it was cleared
                    self.cleared.add(partition)
            raise

    async def _create_for_put(self, partition: str, create: Any, new_rows: bool) -> None:
        if not new_rows:
            raise BadPutError(f"put into {partition!r}: only a put of new rows may create its partition")
        if not isinstance(create, dict) or set(create) - {"tasks", "close_at"}:
            raise ValueError(f"put into {partition!r}: create must be a dict of create_partition's tasks and "
                             f"close_at, got {create!r}")
        await self.rpc_create_partition(partition, create.get("tasks", ()), create.get("close_at"))

    def _record(self, partition: str, rows: Any, columns: dict[str, Any], new_rows: bool, tokens: Any,
                groups: Any, unit: int | None) -> None:
        p = self._partition(partition)
        rows = ids_from_wire(rows)
        tokens = ids_from_wire(tokens) if tokens is not None else None
        groups = ids_from_wire(groups) if groups is not None else None
        schemas = {c: FieldSchema.from_wire(w) for c, w in columns.items()}
        self._check_write(p, rows, schemas, new_rows, groups)
        # --- nothing was changed above; apply -------------------------------------------
        add = 0
        for c, s in schemas.items():
            if c not in p.bit:
                p.bit[c] = len(p.bit)
            if c not in p.schema:  # a reader may have given the column its bit before any write
                p.schema[c] = s
            add |= 1 << p.bit[c]
        touched: dict[int, _Subscription] = {}
        for c in schemas:
            for sub in p.subs_by_column.get(c, ()):
                touched[id(sub)] = sub
        rows_map = p.rows
        if new_rows:  # bulk dict operations: C loops, not Python ones
            rows_map.update(dict.fromkeys(rows, add))
            if groups is not None:
                p.groups.update(zip(rows, groups))
            if tokens is not None:
                p.tokens.update(zip(rows, tokens))
            fresh = dict.fromkeys(rows)  # new rows: no task has consumed them
            for sub in touched.values():
                if add & sub.mask == sub.mask:
                    sub.ready.add(fresh)
        else:
            olds = [rows_map[r] for r in rows]
            for r, old in zip(rows, olds):
                rows_map[r] = old | add
            if tokens is not None:
                for r, t in zip(rows, tokens):
                    p.tokens[r] = p.tokens.get(r, 0) + t
            for sub in touched.values():
                m = sub.mask
                consumed = p.consumed.get(sub.task, ())
                sub.ready.add([r for r, old in zip(rows, olds)
                               if old & m != m and (old | add) & m == m and r not in consumed])
        if not new_rows and unit is not None:
            self._record_where(p, rows, schemas, int(unit))
        if new_rows and p.close_at is not None and len(rows_map) >= p.close_at:
            p.closed = True  # the row count given at creation is reached: the end of the stream
        self.stats["notify"] += 1
        p.wake()

    @staticmethod
    def _record_where(p: _Partition, rows: list[int], columns: dict[str, FieldSchema], unit: int) -> None:
        if rows and unit_of(min(rows)) == unit_of(max(rows)) == unit:
            return  # all at home: the common case, nothing to remember
        away = [r for r in rows if unit_of(r) != unit]
        if away:
            for c in columns:
                p.where.setdefault(c, {}).update(dict.fromkeys(away, unit))

    # ---- reads -------------------------------------------------------------------------

    def _subscription(self, p: _Partition, task: str, columns: tuple[str, ...]) -> _Subscription:
        per_task = p.subs.setdefault(task, {})
        sub = per_task.get(columns)
        if sub is not None:
            return sub
        mask = p.mask_giving_bits(columns)
        sub = _Subscription(task, columns, mask)
        consumed = p.consumed.get(task, ())
        # The one scan of the partition, when a (task, columns) pair is first asked for.
        if consumed:
            sub.ready.add([r for r, m in p.rows.items() if m & mask == mask and r not in consumed])
        else:
            sub.ready.add([r for r, m in p.rows.items() if m & mask == mask])
        per_task[columns] = sub
        for c in columns:
            p.subs_by_column.setdefault(c, []).append(sub)
        return sub

    def _consume(self, p: _Partition, task: str, rows: list[int]) -> None:
        p.consumed.setdefault(task, set()).update(rows)
        for sub in p.subs.get(task, {}).values():
            sub.ready.remove(rows)

    def _meta(self, p: _Partition, rows: list[int], columns: Sequence[str], dp_parts: list[int]) -> BatchMeta:
        groups = [p.groups.get(r, -1) for r in rows] if p.groups else []
        return BatchMeta(p.name, rows, list(columns), groups, list(map(p.tokens.get, rows, repeat(0))),
                         False, dp_parts, self._locations(p, rows, columns))

    @staticmethod
    def _locations(p: _Partition, rows: list[int], columns: Sequence[str]) -> dict[str, list[int]]:
        """Per column stored off-home for some of ``rows``: the unit of each row."""
        out = {}
        for c in columns:
            w = p.where.get(c)
            if w and rows and any(map(w.__contains__, rows)):
                out[c] = [w.get(r, unit_of(r)) for r in rows]
        return out

    async def rpc_locate(self, partition: str, rows: Any, columns: Sequence[str]) -> dict[str, Any]:
        """Where ``columns`` of ``rows`` are stored, for a reader whose meta does not say."""
        p = self._partition(partition)
        return {c: ids_to_wire(u) for c, u in self._locations(p, ids_from_wire(rows), columns).items()}

    def _missing_report(self, p: _Partition, task: str, columns: tuple[str, ...]) -> str:
        consumed = p.consumed.get(task, ())
        lacking: dict[str, int] = dict.fromkeys(columns, 0)
        for r, m in p.rows.items():
            if r in consumed:
                continue
            for c in columns:
                b = p.bit.get(c)
                if b is None or not m >> b & 1:
                    lacking[c] += 1
        return ", ".join(f"{c}: {n} rows lack it" for c, n in lacking.items() if n) or "none"

    async def rpc_get_meta(self, partition: str, task: str, columns: Sequence[str], batch_size: int,
                           sampler: SamplerSpec = "sequential", allow_partial: bool = False,
                           timeout: float | None = None, dp_group: str | None = None,
                           dp_rank: int = 0, dp_size: int = 1, min_rows: int = 0) -> dict[str, Any]:
        return (await self._get_meta(partition, task, columns, batch_size, sampler, allow_partial, timeout,
                                     dp_group, dp_rank, dp_size, min_rows))[1]

    async def _get_meta(self, partition: str, task: str, columns: Sequence[str], batch_size: int,
                        sampler: SamplerSpec, allow_partial: bool, timeout: float | None, dp_group: str | None,
                        dp_rank: int, dp_size: int, min_rows: int = 0) -> tuple[BatchMeta | None, dict[str, Any]]:
        """get_meta's ``(meta, wire)``; meta None when only the wire form is at hand (a DP share).
        ``min_rows`` (0: ``batch_size``): the batch may go once that many rows are ready, with
        every ready row up to ``batch_size`` (a reader that fell behind takes what piled up in one)."""
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if not columns or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"get_meta needs a non-empty list of column names, got {columns!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(min_rows, int) or not 0 <= min_rows <= batch_size:
            raise ValueError(f"min_rows must be an integer within 0..batch_size ({batch_size}), got {min_rows!r}")
        p = self._partition(partition)
        self._check_task(p, task)  # before anything is consumed
        self.tasks.add(task)
        self.stats["get_meta"] += 1
        cols = tuple(sorted(set(columns)))
        if dp_group is None:
            meta = await self._next_batch(p, task, cols, batch_size, sampler, allow_partial, timeout,
                                          min_rows=min_rows)
            meta.columns = list(columns)
            return meta, meta.to_wire()
        # Data-parallel representative: the first member to ask samples; the others get the same.
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside a group of size {dp_size}")
        share = p.dp_shares.setdefault((task, dp_group), _DPShare(dp_size))
        if share.size != dp_size:
            raise ValueError(f"dp group {dp_group!r} of task {task!r} has size {share.size}, not {dp_size}")
        seq = share.next_seq.get(dp_rank, share.base)
        while seq - share.base >= len(share.batches):
            if seq - share.base == len(share.batches):
                # Stop waiting as soon as another member samples this batch for the group.
                sampled = await self._next_batch(p, task, cols, batch_size, sampler, allow_partial, timeout,
                                                 done=lambda: seq - share.base < len(share.batches),
                                                 min_rows=min_rows)
                if sampled is None:
                    continue
                sampled.columns = list(columns)
                if seq - share.base == len(share.batches):  # nobody else sampled while we waited
                    share.batches.append((sampled.to_wire(), set()))
                    p.wake()  # members waiting for this batch take it now
                else:  # another member sampled first: hand our rows back
                    self._unconsume(p, task, sampled.rows)
            else:
                raise RuntimeError("dp share sequence out of order")
        wire, took = share.batches[seq - share.base]
        took.add(dp_rank)
        share.next_seq[dp_rank] = seq + 1
        while share.batches and len(share.batches[0][1]) == share.size:
            share.batches.pop(0)
            share.base += 1
        return None, wire

    async def rpc_get_batch(self, partition: str, task: str, columns: Sequence[str], batch_size: int,
                            sampler: SamplerSpec = "sequential", allow_partial: bool = False,
                            timeout: float | None = None, dp_group: str | None = None,
                            dp_rank: int = 0, dp_size: int = 1,
                            data_columns: Sequence[str] | None = None, min_rows: int = 0) -> dict[str, Any]:
        """get_meta plus, in the same reply, the data of its rows when every unit holding them
        runs in this process (the in-process default): one hop instead of two for a reader
        that wants the bytes at once. ``reads`` (absent otherwise: the client then reads as
        get_data does) holds one unit reply per read request, as the client would plan it.
        The rows are consumed exactly as by get_meta; the bytes are views of the units'
        buffers passed through, never kept here."""
        meta, wire = await self._get_meta(partition, task, columns, batch_size, sampler, allow_partial, timeout,
                                          dp_group, dp_rank, dp_size, min_rows)
        names = list(columns if data_columns is None else data_columns)
        if not len(wire["rows"]) or not names or not all(isinstance(c, str) for c in names):
            return {"meta": wire}  # nothing to read, or names get_data would refuse: the client says why
        reads = self._read_local(meta if meta is not None else BatchMeta.from_wire(wire), names, wire["rows"])
        return {"meta": wire} if reads is None else {"meta": wire, "reads": reads}

    def _read_local(self, meta: BatchMeta, names: list[str], rows_wire: Any) -> list[dict[str, Any]] | None:
        """The unit replies for ``names`` of ``meta``'s rows, or None when a unit is in another
        process or a read fails (the client's own read then reports it). Reads the units
        directly, without suspending (``rows_wire``: the meta's row ids as sent, reused as
        the read's ids when one read takes every row). ``pos`` None: all rows, in order."""
        p = self.partitions.get(meta.partition)
        if p is None:
            return None
        extra = self._locations(p, meta.rows, [c for c in names if c not in meta.locations])
        if extra:
            meta = replace(meta, locations={**meta.locations, **extra})
        requests = plan_reads(meta, names)
        eps = [ep for u, _, _ in requests if isinstance(ep := self.units.get(u), LocalEndpoint)
               and hasattr(ep.service, "read")]
        if len(eps) != len(requests):
            return None
        whole = len(requests) == 1 and hasattr(rows_wire, "numel")  # (one unit holds every column)
        out = []
        try:
            for ep, (u, pos, cols) in zip(eps, requests):
                rows = rows_wire if whole else ids_to_wire([meta.rows[i] for i in pos])
                out.append({"unit": u, "pos": None if whole else ids_to_wire(pos), "cols": cols,
                            "data": ep.service.read(meta.partition, rows, cols)})
        except Exception:  # noqa: BLE001  (e.g. rows cleared meanwhile: get_data raises it with context)
            return None
        return out

    def _unconsume(self, p: _Partition, task: str, rows: list[int]) -> None:
        p.consumed.get(task, set()).difference_update(rows)
        for sub in p.subs.get(task, {}).values():
            mask = sub.mask
            sub.ready.add([r for r in rows if (m := p.rows.get(r)) is not None and m & mask == mask])
        p.wake()

    @overload
    async def _next_batch(self, p: _Partition, task: str, cols: tuple[str, ...], batch_size: int,
                          sampler_spec: SamplerSpec, allow_partial: bool, timeout: float | None,
                          done: None = None, min_rows: int = 0) -> BatchMeta: ...

    @overload
    async def _next_batch(self, p: _Partition, task: str, cols: tuple[str, ...], batch_size: int,
                          sampler_spec: SamplerSpec, allow_partial: bool, timeout: float | None,
                          done: Callable[[], bool], min_rows: int = 0) -> BatchMeta | None: ...

    async def _next_batch(self, p: _Partition, task: str, cols: tuple[str, ...], batch_size: int,
                          sampler_spec: SamplerSpec, allow_partial: bool, timeout: float | None,
                          done: Callable[[], bool] | None = None, min_rows: int = 0) -> BatchMeta | None:
        """The next batch for ``task``; None once ``done()`` is true (a DP peer sampled it).
        ``min_rows``: a batch of at least that many ready rows goes (up to ``batch_size``)."""
        sampler = self._sampler(sampler_spec)
        timeout = self.default_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        while True:
            if p.cleared:
                raise RowsClearedError(f"partition {p.name!r} was cleared while task {task!r} waited for rows")
            if done is not None and done():
                return None
            # Looked up on every wake: reset_consumption replaces the task's subscriptions.
            sub = self._subscription(p, task, cols)
            pending = len(p.rows) - len(p.consumed.get(task, ()))
            # End of stream: no new rows, and every row this task has yet to see is ready.
            ended = p.closed and pending == len(sub.ready)
            some = bool(min_rows) and len(sub.ready) >= min_rows  # enough may be ready for a smaller batch
            got = sampler.sample(sub.ready, batch_size, p, partial=allow_partial or some, ended=ended)
            if got is not None and some and not allow_partial and not ended and len(got.rows) < min_rows:
                got = None  # fewer whole groups than asked for: wait for more
            if got is not None and got.rows:
                self._consume(p, task, got.rows)
                self.stats["rows_ready"] += len(got.rows)
                return self._meta(p, got.rows, cols, got.dp_parts)
            if ended:
                m = self._meta(p, [], cols, [])
                m.end_of_stream = True
                return m
            if allow_partial:
                return self._meta(p, [], cols, [])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferQueueTimeout(
                    f"get_meta timed out after {timeout:.1f}s: partition {p.name!r}, task {task!r} wants "
                    f"{batch_size} rows with columns {list(cols)}; {len(sub.ready)} ready, {pending} not yet "
                    f"consumed; missing columns: {self._missing_report(p, task, cols)}"
                    f"{'' if p.closed else '; the partition is still open (close_partition ends the stream)'}")
            try:
                # wait_within, not wait_for: a cancelled get_meta (its caller gave up) must end here,
                # never go on to consume rows for nobody (3.11's wait_for can drop the cancellation)
                await wait_within(p.changed.wait(), left)
            except TimeoutError:
                pass
