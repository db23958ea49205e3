"""A storage unit: holds the bytes of the rows routed to it, column by column.

Each put is kept as one *batch* of columns exactly as it arrived (for a put from
another process, the tensors still live in the received ZMQ frames: no copy).
A row's column is found through ``(batch, position)``; reading rows that sit
contiguously in one batch is a view, other reads gather once. A batch is freed when
its last row is dropped. Row capacity and byte capacity bound the unit: a put of new
rows waits (backpressure) until clears make room.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .columns import Column, JaggedColumn, column_from_wire, column_to_wire, concat
from .errors import BadPutError, CapacityError, RowsClearedError, UnknownPartitionError
from .meta import make_row_id, unit_of

_POS_BITS = 32  # a row's location in a unit: batch id in the high bits, position in the low
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass
class _Batch:
    columns: dict[str, Column]
    nbytes: int
    live: int  # rows of this batch still referenced by any column index


class _PartitionStore:
    def __init__(self) -> None:
        self.where: dict[str, dict[int, int]] = {}  # column -> row -> batch id << 32 | position
        self.rows: set[int] = set()
        self.batch_rows: dict[int, list[int]] = {}  # batch id -> its rows, to free it


class StorageUnit:
    def __init__(self, index: int, controller: Any, max_rows: int | None = None,
                 max_bytes: int | None = None, put_timeout: float = 300.0):
        self.index = index
        self.controller = controller  # endpoint with .call(...)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.put_timeout = put_timeout
        self.parts: dict[str, _PartitionStore] = {}
        self.dropped: set[str] = set()
        self.batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count()
        self._next_local = 0
        self.used_rows = 0
        self.used_bytes = 0
        self._freed = asyncio.Event()

    # ---- capacity -----------------------------------------------------------------------

    def _fits(self, rows: int, nbytes: int) -> bool:
        return ((self.max_rows is None or self.used_rows + rows <= self.max_rows)
                and (self.max_bytes is None or self.used_bytes + nbytes <= self.max_bytes))

    async def _wait_for_room(self, partition: str, rows: int, nbytes: int, timeout: float | None) -> None:
        if (self.max_rows is not None and rows > self.max_rows) or (
                self.max_bytes is not None and nbytes > self.max_bytes):
            raise CapacityError(
                f"storage unit {self.index}: a put of {rows} rows / {nbytes} bytes into {partition!r} can "
                f"never fit (capacity {self.max_rows} rows / {self.max_bytes} bytes); split the put or raise "
                "the capacity")
        timeout = self.put_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self._fits(rows, nbytes):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CapacityError(
                    f"storage unit {self.index} stayed full for {timeout:.1f}s (rows {self.used_rows}/"
                    f"{self.max_rows}, bytes {self.used_bytes}/{self.max_bytes}); a put of {rows} rows into "
                    f"{partition!r} waited for room: clear consumed partitions or rows, or raise the capacity")
            freed = self._freed
            try:
                await asyncio.wait_for(freed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _signal_freed(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    # ---- writes -------------------------------------------------------------------------

    def _store(self, partition: str, rows: list[int], cols: dict[str, Column]) -> int:
        ps = self.parts.setdefault(partition, _PartitionStore())
        self.dropped.discard(partition)
        bid = next(self._batch_ids)
        nbytes = sum(c.nbytes for c in cols.values())
        self.batches[bid] = _Batch(cols, nbytes, len(rows) * len(cols))
        ps.batch_rows[bid] = rows
        base = bid << _POS_BITS
        for name in cols:
            ps.where.setdefault(name, {}).update(zip(rows, range(base, base + len(rows))))
        self.used_bytes += nbytes
        return bid

    def _unstore(self, partition: str, bid: int, new_rows: bool) -> None:
        ps = self.parts[partition]
        batch = self.batches.pop(bid)
        rows = ps.batch_rows.pop(bid)
        for name in batch.columns:
            where = ps.where[name]
            for r in rows:
                where.pop(r, None)
        if new_rows:
            ps.rows.difference_update(rows)
            self.used_rows -= len(rows)
        self.used_bytes -= batch.nbytes

    async def rpc_put(self, partition: str, columns: dict, rows: Sequence[int] | None = None,
                      groups: Sequence[int] | None = None, timeout: float | None = None) -> dict:
        """Store columns for new rows (``rows`` None: this unit assigns ids) or add columns
        to existing rows of this unit. Returns the row ids and per-row token counts."""
        cols = {name: column_from_wire(w) for name, w in columns.items()}
        if not cols:
            raise BadPutError(f"put into {partition!r} carries no columns")
        counts = {k: len(c) for k, c in cols.items()}
        n = next(iter(counts.values()))
        if len(set(counts.values())) != 1:
            raise BadPutError(f"put into {partition!r}: columns have different row counts {counts}")
        new_rows = rows is None
        if not new_rows and len(rows) != n:
            raise BadPutError(f"put into {partition!r}: {n} rows of data for {len(rows)} row ids")
        if groups is not None and len(groups) != n:
            raise BadPutError(f"put into {partition!r}: {len(groups)} group ids for {n} rows")
        nbytes = sum(c.nbytes for c in cols.values())
        if new_rows:
            await self._wait_for_room(partition, n, nbytes, timeout)
            first = make_row_id(self.index, self._next_local)
            self._next_local += n
            row_ids = list(range(first, first + n))
        else:
            row_ids = [int(r) for r in rows]
            ps = self.parts.get(partition)
            foreign = [r for r in row_ids if unit_of(r) != self.index]
            if foreign:
                raise BadPutError(f"storage unit {self.index} got rows {foreign[:5]} that live on other units")
            missing = [r for r in row_ids if ps is None or r not in ps.rows]
            if missing:
                raise RowsClearedError(f"partition {partition!r}: rows {missing[:5]} are not stored in unit "
                                       f"{self.index} (cleared, or never created)")
            for name in cols:
                where = ps.where.get(name, {})
                again = [r for r in row_ids if r in where]
                if again:
                    raise BadPutError(f"partition {partition!r}: rows {again[:5]} already have column "
                                      f"{name!r}; columns are written once per row")
        # No await between the checks above and storing: the unit's view cannot change.
        fresh, was_dropped = partition not in self.parts, partition in self.dropped
        bid = self._store(partition, row_ids, cols)
        if new_rows:
            self.parts[partition].rows.update(row_ids)
            self.used_rows += n
        lens = [c.lengths() for c in cols.values() if isinstance(c, JaggedColumn)]
        tokens = torch.stack(lens).sum(0).tolist() if lens else [0] * n
        try:
            await self.controller.call(
                "notify", partition=partition, rows=row_ids, new_rows=new_rows,
                columns={k: c.schema.to_wire() for k, c in cols.items()}, tokens=tokens,
                groups=list(groups) if groups is not None else None)
        except BaseException:
            self._unstore(partition, bid, new_rows)  # the controller refused: leave no trace
            ps = self.parts.get(partition)
            if fresh and ps is not None and not ps.rows and not ps.batch_rows:
                del self.parts[partition]
            if was_dropped and partition not in self.parts:
                self.dropped.add(partition)  # reads keep saying the partition was cleared
            raise
        return {"rows": row_ids, "tokens": tokens}

    # ---- reads --------------------------------------------------------------------------

    async def rpc_get(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> dict:
        ps = self.parts.get(partition)
        if ps is None:
            if partition in self.dropped:
                raise RowsClearedError(f"partition {partition!r} was cleared; its rows cannot be read")
            raise UnknownPartitionError(f"storage unit {self.index} holds no partition {partition!r}")
        if not rows:
            raise BadPutError(f"get of no rows from partition {partition!r}")
        out = {}
        for name in columns:
            where = ps.where.get(name)
            if where is None:
                raise BadPutError(f"partition {partition!r} has no column {name!r} in unit {self.index}")
            try:
                codes = [where[r] for r in rows]
            except KeyError as e:
                r = e.args[0]
                why = "was cleared" if r not in ps.rows else f"has no column {name!r} yet"
                raise RowsClearedError(f"partition {partition!r}: row {r} {why}") from None
            out[name] = column_to_wire(self._gather(name, codes))
        return out

    def _gather(self, name: str, codes: list[int]) -> Column:
        """Rows at ``codes`` in order: runs of consecutive positions in one batch are views."""
        n = len(codes)
        if codes[-1] - codes[0] == n - 1 and codes == list(range(codes[0], codes[0] + n)):
            runs = [(0, n)]  # the common case: a batch read back as it was written
        else:
            c = torch.tensor(codes)
            breaks = (torch.nonzero(c.diff() != 1).flatten() + 1).tolist()
            bounds = [0, *breaks, n]
            runs = list(zip(bounds[:-1], bounds[1:]))
        pieces = []
        for a, b in runs:
            bid, pos = codes[a] >> _POS_BITS, codes[a] & _POS_MASK
            pieces.append(self.batches[bid].columns[name].take(range(pos, pos + b - a)))
        return concat(pieces)

    # ---- frees --------------------------------------------------------------------------

    def _drop(self, ps: _PartitionStore, rows: Sequence[int]) -> None:
        for name, where in ps.where.items():
            for r in rows:
                code = where.pop(r, None)
                if code is None:
                    continue
                bid = code >> _POS_BITS
                b = self.batches.get(bid)
                if b is None:
                    continue
                b.live -= 1
                if b.live == 0:
                    self.batches.pop(bid)
                    ps.batch_rows.pop(bid, None)
                    self.used_bytes -= b.nbytes
        gone = ps.rows.intersection(rows)
        ps.rows.difference_update(gone)
        self.used_rows -= len(gone)

    async def rpc_drop_rows(self, partition: str, rows: Sequence[int]) -> None:
        ps = self.parts.get(partition)
        if ps is not None:
            self._drop(ps, rows)
            self._signal_freed()

    async def rpc_drop_partition(self, partition: str) -> None:
        ps = self.parts.pop(partition, None)
        self.dropped.add(partition)
        if ps is None:
            return
        for bid in ps.batch_rows:
            b = self.batches.pop(bid, None)
            if b is not None:
                self.used_bytes -= b.nbytes
        self.used_rows -= len(ps.rows)
        self._signal_freed()

    async def rpc_stats(self) -> dict:
        return {"unit": self.index, "rows": self.used_rows, "bytes": self.used_bytes,
                "batches": len(self.batches), "partitions": len(self.parts)}
