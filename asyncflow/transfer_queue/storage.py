"""A storage unit: holds the bytes of the rows routed to it, column by column.

Each put is kept as one *batch* of columns exactly as it arrived (for a put from
another process the tensors still live in the received ZMQ frames: no copy). The
unit gives new rows consecutive local ids, so a partition's row index is a tensor
over its span of ids: per column, ``batch id << 32 | position`` or -1. Finding,
checking and freeing rows are tensor operations, not per-row Python work. Reading
rows that sit contiguously in one batch is a view; other reads gather once per
batch. A batch is freed when its last row is dropped. Row and byte capacity bound
the unit: a put of new rows waits (backpressure) until clears make room.
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
from .meta import LOCAL_MASK, MAX_UNITS, ids_from_wire, make_row_id
from .recent import RecentSet

_POS_BITS = 32  # a row's location in a unit: batch id in the high bits, position in the low
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass
class _Batch:
    columns: dict[str, Column]
    nbytes: int
    live: int  # (row, column) cells of this batch still indexed


class _PartitionStore:
    """Row index of one partition in one unit, over local ids ``base .. base + size``."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.exists = torch.zeros(0, dtype=torch.bool)
        self.ever = torch.zeros(0, dtype=torch.bool)  # rows this partition had, cleared or not
        self.codes: dict[str, torch.Tensor] = {}  # column -> int64 [size]; -1 where absent
        self.batches: set[int] = set()
        self.nrows = 0

    @property
    def size(self) -> int:
        return self.exists.shape[0]

    def grow(self, upto: int) -> None:
        if upto <= self.size:
            return
        new = max(upto, 2 * self.size, 1024)  # amortised doubling
        ex = torch.zeros(new, dtype=torch.bool)
        ex[:self.size] = self.exists
        ev = torch.zeros(new, dtype=torch.bool)
        ev[:self.size] = self.ever
        self.ever = ev
        for name, c in self.codes.items():
            nc = torch.full((new,), -1, dtype=torch.long)
            nc[:self.size] = c
            self.codes[name] = nc
        self.exists = ex

    def column(self, name: str) -> torch.Tensor:
        c = self.codes.get(name)
        if c is None:
            c = self.codes[name] = torch.full((self.size,), -1, dtype=torch.long)
        return c

    def index_of(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Positions of ``rows`` in the index, or None if any lies outside it."""
        idx = (rows & LOCAL_MASK) - self.base
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.size):
            return None
        return idx


class StorageUnit:
    def __init__(self, index: int, controller: Any, max_rows: int | None = None,
                 max_bytes: int | None = None, put_timeout: float = 300.0):
        if not 0 <= index < MAX_UNITS:
            raise ValueError(f"storage unit index {index} outside 0..{MAX_UNITS - 1}")
        self.index = index
        self.controller = controller  # endpoint with .call(...)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.put_timeout = put_timeout
        self.parts: dict[str, _PartitionStore] = {}
        self.dropped = RecentSet()
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

    def _missing_error(self, partition: str, ps: _PartitionStore | None, rows: torch.Tensor,
                       idx: torch.Tensor | None) -> RowsClearedError:
        if ps is not None and idx is not None:
            gone = ~ps.exists[idx]
            cleared = rows[gone & ps.ever[idx]]
            if cleared.numel():
                return RowsClearedError(f"partition {partition!r}: rows {cleared[:5].tolist()} were cleared")
            rows = rows[gone]
        return RowsClearedError(f"partition {partition!r}: rows {rows[:5].tolist()} were never stored in "
                                f"unit {self.index}")

    async def rpc_put(self, partition: str, columns: dict, rows: Any = None,
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
        groups = ids_from_wire(groups) if groups is not None else None
        if groups is not None and len(groups) != n:
            raise BadPutError(f"put into {partition!r}: {len(groups)} group ids for {n} rows")
        nbytes = sum(c.nbytes for c in cols.values())
        if new_rows:
            await self._wait_for_room(partition, n, nbytes, timeout)
            first = self._next_local
            self._next_local += n
            row_t = torch.arange(make_row_id(self.index, first), make_row_id(self.index, first) + n)
        else:
            row_t = torch.as_tensor(ids_from_wire(rows, tensor=True), dtype=torch.long)
            if row_t.numel() != n:
                raise BadPutError(f"put into {partition!r}: {n} rows of data for {row_t.numel()} row ids")
            foreign = row_t[(row_t >> 40) != self.index]
            if foreign.numel():
                raise BadPutError(f"storage unit {self.index} got rows {foreign[:5].tolist()} that live on "
                                  "other units")
            ps = self.parts.get(partition)
            idx = ps.index_of(row_t) if ps is not None else None
            if ps is None or idx is None or not bool(ps.exists[idx].all()):
                raise self._missing_error(partition, ps, row_t, idx)
            for name in cols:
                c = ps.codes.get(name)
                if c is not None:
                    again = row_t[c[idx] >= 0]
                    if again.numel():
                        raise BadPutError(f"partition {partition!r}: rows {again[:5].tolist()} already have "
                                          f"column {name!r}; columns are written once per row")
            if int(torch.unique(idx).numel()) != n:
                raise BadPutError(f"put into {partition!r} names a row twice")
        # No await between the checks above and storing: the unit's view cannot change.
        fresh, was_dropped = partition not in self.parts, partition in self.dropped
        bid = self._store(partition, row_t, cols, new_rows)
        lens = [c.lengths() for c in cols.values() if isinstance(c, JaggedColumn)]
        tokens = torch.stack(lens).sum(0) if lens else torch.zeros(n, dtype=torch.long)
        try:
            await self.controller.call(
                "notify", partition=partition, rows=row_t, new_rows=new_rows,
                columns={k: c.schema.to_wire() for k, c in cols.items()}, tokens=tokens,
                groups=groups)
        except BaseException:
            if bid in self.batches and partition in self.parts:  # the controller refused: leave no trace
                self._unstore(partition, bid, row_t, new_rows)  # (a clear meanwhile already freed it)
            if fresh and self.parts.get(partition) is not None and not self.parts[partition].nrows:
                del self.parts[partition]
            if was_dropped and partition not in self.parts:
                self.dropped.add(partition)  # reads keep saying the partition was cleared
            raise
        return {"rows": row_t, "tokens": tokens}

    def _store(self, partition: str, rows: torch.Tensor, cols: dict[str, Column], new_rows: bool) -> int:
        ps = self.parts.get(partition)
        if ps is None:
            ps = self.parts[partition] = _PartitionStore(int(rows[0]) & LOCAL_MASK if rows.numel() else 0)
            self.dropped.discard(partition)
        n = rows.numel()
        bid = next(self._batch_ids)
        nbytes = sum(c.nbytes for c in cols.values())
        self.batches[bid] = _Batch(cols, nbytes, n * len(cols))
        ps.batches.add(bid)
        codes = torch.arange(bid << _POS_BITS, (bid << _POS_BITS) + n)
        if new_rows:
            a = (int(rows[0]) & LOCAL_MASK) - ps.base if n else 0
            ps.grow(a + n)
            ps.exists[a:a + n] = True
            ps.ever[a:a + n] = True
            for name in cols:
                ps.column(name)[a:a + n] = codes
            ps.nrows += n
            self.used_rows += n
        else:
            idx = ps.index_of(rows)
            for name in cols:
                ps.column(name)[idx] = codes
        self.used_bytes += nbytes
        return bid

    def _unstore(self, partition: str, bid: int, rows: torch.Tensor, new_rows: bool) -> None:
        ps = self.parts[partition]
        batch = self.batches.pop(bid)
        ps.batches.discard(bid)
        idx = ps.index_of(rows)
        for name in batch.columns:
            ps.codes[name][idx] = -1
        if new_rows:
            ps.exists[idx] = False
            ps.ever[idx] = False
            ps.nrows -= rows.numel()
            self.used_rows -= rows.numel()
        self.used_bytes -= batch.nbytes

    # ---- reads --------------------------------------------------------------------------

    async def rpc_get(self, partition: str, rows: Any, columns: Sequence[str]) -> dict:
        ps = self.parts.get(partition)
        if ps is None:
            if partition in self.dropped:
                raise RowsClearedError(f"partition {partition!r} was cleared; its rows cannot be read")
            raise UnknownPartitionError(f"storage unit {self.index} holds no partition {partition!r}")
        row_t = torch.as_tensor(ids_from_wire(rows, tensor=True), dtype=torch.long)
        if not row_t.numel():
            raise BadPutError(f"get of no rows from partition {partition!r}")
        idx = ps.index_of(row_t)
        if idx is None or not bool(ps.exists[idx].all()):
            raise self._missing_error(partition, ps, row_t, idx)
        missing = [n for n in columns if n not in ps.codes]
        if missing:
            raise BadPutError(f"partition {partition!r} has no column {missing[0]!r} in unit {self.index}")
        # All columns' locations at once: one check for holes, one for contiguous runs.
        codes = torch.stack([ps.codes[n][idx] for n in columns])
        if bool((codes < 0).any()):
            name = columns[int(torch.nonzero((codes < 0).any(1))[0])]
            lacking = row_t[ps.codes[name][idx] < 0]
            raise RowsClearedError(f"partition {partition!r}: rows {lacking[:5].tolist()} have no column "
                                   f"{name!r} yet")
        n = row_t.numel()
        runs = (codes.diff(dim=1) == 1).all(1).tolist() if n > 1 else [True] * len(columns)
        firsts = codes[:, 0].tolist()
        out = {}
        for j, name in enumerate(columns):
            if runs[j]:  # one batch read as it was written: a view
                pos = firsts[j] & _POS_MASK
                col = self.batches[firsts[j] >> _POS_BITS].columns[name].take(range(pos, pos + n))
            else:
                col = self._gather(name, codes[j])
            out[name] = column_to_wire(col)
        return out

    def _gather(self, name: str, codes: torch.Tensor) -> Column:
        """Rows at ``codes`` in order: one gather per batch, then back in the requested order."""
        n = codes.numel()
        first = int(codes[0])
        bids = codes >> _POS_BITS
        pos = codes & _POS_MASK
        if bool((bids == bids[0]).all()):
            return self.batches[first >> _POS_BITS].columns[name].take(pos.tolist())
        order = torch.argsort(bids, stable=True)
        sb = bids[order]
        uniq, counts = torch.unique_consecutive(sb, return_counts=True)
        pieces, start = [], 0
        for b, k in zip(uniq.tolist(), counts.tolist()):
            sel = order[start:start + k]
            pieces.append(self.batches[b].columns[name].take(pos[sel].tolist()))
            start += k
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(n)
        return concat(pieces).take(inverse.tolist())

    # ---- frees --------------------------------------------------------------------------

    def _free_cells(self, ps: _PartitionStore, codes: torch.Tensor) -> None:
        """One (row, column) cell fewer in each batch named by ``codes``; free emptied batches."""
        codes = codes[codes >= 0]
        if not codes.numel():
            return
        uniq, counts = torch.unique(codes >> _POS_BITS, return_counts=True)
        for b, k in zip(uniq.tolist(), counts.tolist()):
            batch = self.batches.get(b)
            if batch is None:
                continue
            batch.live -= k
            if batch.live <= 0:
                del self.batches[b]
                ps.batches.discard(b)
                self.used_bytes -= batch.nbytes

    async def rpc_drop_rows(self, partition: str, rows: Any) -> None:
        ps = self.parts.get(partition)
        if ps is None:
            return
        row_t = torch.as_tensor(ids_from_wire(rows, tensor=True), dtype=torch.long)
        idx = (row_t & LOCAL_MASK) - ps.base
        idx = idx[(idx >= 0) & (idx < ps.size)]
        idx = idx[ps.exists[idx]]
        for c in ps.codes.values():
            self._free_cells(ps, c[idx])
            c[idx] = -1
        ps.exists[idx] = False
        ps.nrows -= idx.numel()
        self.used_rows -= idx.numel()
        self._signal_freed()

    async def rpc_drop_partition(self, partition: str) -> None:
        ps = self.parts.pop(partition, None)
        self.dropped.add(partition)
        if ps is None:
            return
        for bid in ps.batches:
            b = self.batches.pop(bid, None)
            if b is not None:
                self.used_bytes -= b.nbytes
        self.used_rows -= ps.nrows
        self._signal_freed()

    async def rpc_stats(self) -> dict:
        return {"unit": self.index, "rows": self.used_rows, "bytes": self.used_bytes,
                "batches": len(self.batches), "partitions": len(self.parts)}
