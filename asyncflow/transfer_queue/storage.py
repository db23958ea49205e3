"""A storage unit: holds the bytes of the rows routed to it, column by column.

Each put is kept as one *batch* of columns exactly as it arrived (for a put from
another process the tensors still live in the received ZMQ frames: no copy). The
unit gives new rows consecutive local ids, so a partition's row index is a tensor
over its span of ids: per column, ``batch id << 32 | position`` or -1. Finding,
checking and freeing rows are tensor operations, not per-row Python work. Reading
rows that sit contiguously in one batch is a view; other reads gather once per
batch. A batch is freed when its last row is dropped. Row and byte capacity bound
the unit: a put of new rows waits (backpressure) until clears make room.

A unit also keeps columns that a producer on its node added to rows living in another
unit ("foreign" rows: the controller records where such a column is). They are indexed
per home unit like the unit's own rows, but hold no row of their own: row capacity
counts the unit's own rows, bytes count everything stored.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..rpc.codec import CodecError
from ..rpc.waits import wait_within
from .columns import Column, JaggedColumn, column_from_wire, column_to_wire, concat
from .errors import BadPutError, CapacityError, MissingColumnError, RowsClearedError, UnknownPartitionError
from .meta import LOCAL_MASK, MAX_UNITS, UNIT_SHIFT, ids_from_wire, make_row_id
from .recent import RecentSet

_POS_BITS = 32  # a row's location in a unit: batch id in the high bits, position in the low
_POS_MASK = (1 << _POS_BITS) - 1
_FEW_RUNS = 16  # a read of this many runs or fewer is always concatenated from views
_RUNS_PER_BATCH = 4  # above this many runs per batch touched, gather per batch then reorder


@dataclass
class _StoredBatch:
    columns: dict[str, Column]
    nbytes: int
    live: int  # (row, column) cells of this batch still indexed


def _put_column(partition: str, name: str, w: Any) -> Column:
    """One column of a put, decoded and checked (columns.column_problem): a malformed one is
    refused here, before anything is stored, naming the column. Replies are not checked."""
    try:
        return column_from_wire(w, check=True)
    except CodecError as e:
        raise BadPutError(f"put into {partition!r}: column {name!r}: {e}; nothing was stored") from None


class _PartitionStore:
    """Row index of one partition in one unit, over local ids ``base .. base + size``."""

    def __init__(self, base: int, foreign: bool = False) -> None:
        self.base = base
        self.foreign = foreign  # columns of another unit's rows: ``exists`` means "holds a cell"
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

    def cover(self, lo: int, hi: int) -> None:
        """Make local ids ``lo .. hi-1`` addressable; a foreign store may see ids below its base."""
        if self.size == 0:
            self.base = lo
        elif lo < self.base:
            shift, old = self.base - lo, self.size
            new = max(old + shift, hi - lo, 2 * old)

            def moved(t: torch.Tensor, fill: Any) -> torch.Tensor:
                out = torch.full((new,), fill, dtype=t.dtype)
                out[shift:shift + old] = t
                return out
            self.exists, self.ever = moved(self.exists, False), moved(self.ever, False)
            self.codes = {k: moved(c, -1) for k, c in self.codes.items()}
            self.base = lo
        self.grow(hi - self.base)

    def column(self, name: str) -> torch.Tensor:
        c = self.codes.get(name)
        if c is None:
            c = self.codes[name] = torch.full((self.size,), -1, dtype=torch.long)
        return c

    def index_of(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Positions of ``rows`` in the index, or None if any lies outside it."""
        idx = (rows & LOCAL_MASK) - self.base
        i = idx.numpy()  # min/max of a step's rows: numpy's cost per call is a fraction of torch's
        if i.size and (i.min() < 0 or i.max() >= self.size):
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
        self.batches: dict[int, _StoredBatch] = {}
        self._batch_ids = itertools.count()
        self._next_local = 0
        self.used_rows = 0
        self.used_bytes = 0
        self._freed = asyncio.Event()
        # partition -> home unit -> columns this unit holds for that unit's rows
        self.foreign: dict[str, dict[int, _PartitionStore]] = {}
        # Rows and bytes put here, by the node of the client that put them ("-": not told).
        self.put_rows_by_node: dict[str, int] = {}
        self.put_bytes_by_node: dict[str, int] = {}

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
                await wait_within(freed.wait(), left)  # a cancelled put stores nothing (rpc/waits.py)
            except TimeoutError:
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

    def _groups(self, rows: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """``rows`` split by home unit: ``(home, positions)``; positions None means all rows."""
        homes = rows.numpy() >> UNIT_SHIFT
        if not homes.size or homes.min() == homes.max():  # one home: the common case
            return [(int(homes[0]) if homes.size else self.index, None)]
        return [(int(h), torch.from_numpy(np.flatnonzero(homes == h))) for h in np.unique(homes).tolist()]

    def _store_of(self, partition: str, home: int) -> _PartitionStore | None:
        if home == self.index:
            return self.parts.get(partition)
        return self.foreign.get(partition, {}).get(home)

    def _holds(self, partition: str) -> bool:
        return partition in self.parts or partition in self.foreign

    def _check_column_put(self, partition: str, row_t: torch.Tensor, cols: dict[str, Column]) -> None:
        """A put of columns to existing rows: own rows must exist here and lack those columns.
        Foreign rows are checked by the controller (only it knows they exist); here only that
        this unit does not already hold those columns for them."""
        r = row_t.numpy()
        # rows in increasing order (a meta's usually are) are distinct without sorting them
        if r.size > 1 and not (r[1:] > r[:-1]).all() and np.unique(r).size != r.size:
            raise BadPutError(f"put into {partition!r} names a row twice")
        for home, pos in self._groups(row_t):
            sub = row_t if pos is None else row_t[pos]
            ps = self._store_of(partition, home)
            idx = ps.index_of(sub) if ps is not None else None
            if home == self.index and (ps is None or idx is None or not ps.exists.numpy()[idx.numpy()].all()):
                raise self._missing_error(partition, ps, sub, idx)
            if ps is None or idx is None:
                continue
            i = idx.numpy()
            for name in cols:
                c = ps.codes.get(name)
                if c is not None:
                    held = c.numpy()[i] >= 0
                    if held.any():
                        raise BadPutError(f"partition {partition!r}: rows {sub.numpy()[held][:5].tolist()} already "
                                          f"have column {name!r}; columns are written once per row")

    async def rpc_put(self, partition: str, columns: dict[str, Any], rows: Any = None,
                      groups: Sequence[int] | None = None, timeout: float | None = None,
                      node: int | None = None, create: dict[str, Any] | None = None) -> dict[str, Any]:
        """Store columns for new rows (``rows`` None: this unit assigns ids) or add columns
        to existing rows, this unit's own or another unit's. ``node``: the writer's node
        (counted in stats); ``create``: the controller creates the partition with these rows
        (``{"tasks", "close_at"}``, new rows only). Returns, for new rows, the first row id
        (the ids are consecutive), their count and per-row token counts."""
        cols = {name: _put_column(partition, name, w) for name, w in columns.items()}
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
            if bool((row_t < 0).any()) or bool(((row_t >> UNIT_SHIFT) >= MAX_UNITS).any()):
                raise BadPutError(f"put into {partition!r}: row ids {row_t[:5].tolist()} are not row ids")
            self._check_column_put(partition, row_t, cols)
        # No await between the checks above and storing: the unit's view cannot change.
        fresh, was_dropped = not self._holds(partition), partition in self.dropped
        bid = self._store(partition, row_t, cols, new_rows, nbytes)
        lens = [c.lengths() for c in cols.values() if isinstance(c, JaggedColumn)]
        tokens = torch.stack(lens).sum(0) if lens else torch.zeros(n, dtype=torch.long)
        try:
            await self.controller.call(
                "notify", partition=partition, rows=row_t, new_rows=new_rows,
                columns={k: c.schema.to_wire() for k, c in cols.items()}, tokens=tokens,
                groups=groups, unit=self.index, create=create)
        except BaseException:
            if bid in self.batches:  # the controller refused: leave no trace
                self._unstore(partition, bid, row_t, new_rows)  # (a clear meanwhile already freed it)
            if fresh:
                self._forget_if_empty(partition)
            if was_dropped and not self._holds(partition):
                self.dropped.add(partition)  # reads keep saying the partition was cleared
            raise
        who = "-" if node is None else str(int(node))
        self.put_rows_by_node[who] = self.put_rows_by_node.get(who, 0) + n
        self.put_bytes_by_node[who] = self.put_bytes_by_node.get(who, 0) + nbytes
        if not new_rows:
            return {}  # the writer's meta already names the rows
        # New rows get consecutive ids: two numbers, not an id tensor frame to encode, MAC and decode.
        return {"first": int(make_row_id(self.index, first)), "n": n, "tokens": tokens}

    def _forget_if_empty(self, partition: str) -> None:
        ps = self.parts.get(partition)
        if ps is not None and not ps.nrows:
            del self.parts[partition]
        per_home = self.foreign.get(partition)
        if per_home is not None:
            for home in [h for h, fs in per_home.items() if not bool(fs.exists.any())]:
                del per_home[home]
            if not per_home:
                del self.foreign[partition]

    def _store(self, partition: str, rows: torch.Tensor, cols: dict[str, Column], new_rows: bool,
               nbytes: int) -> int:
        """``nbytes``: the columns' size as the put counted it (an object column's is a loop over
        its items: counted once)."""
        n = rows.numel()
        bid = next(self._batch_ids)
        self.batches[bid] = _StoredBatch(cols, nbytes, n * len(cols))
        self.dropped.discard(partition)
        # The index is written through numpy views of its tensors: a step's few rows cost a
        # fraction of a torch indexing op's fixed cost.
        codes = np.arange(bid << _POS_BITS, (bid << _POS_BITS) + n, dtype=np.int64)
        if new_rows:
            ps = self.parts.get(partition)
            if ps is None:
                ps = self.parts[partition] = _PartitionStore(int(rows[0]) & LOCAL_MASK if n else 0)
            ps.batches.add(bid)
            a = (int(rows[0]) & LOCAL_MASK) - ps.base if n else 0
            ps.grow(a + n)
            ps.exists.numpy()[a:a + n] = True
            ps.ever.numpy()[a:a + n] = True
            for name in cols:
                ps.column(name).numpy()[a:a + n] = codes
            ps.nrows += n
            self.used_rows += n
        else:
            for home, pos in self._groups(rows):
                sub = rows if pos is None else rows[pos]
                ps = self._store_of(partition, home)
                if ps is None:  # only a foreign store can be missing here (checked before)
                    ps = self.foreign.setdefault(partition, {})[home] = _PartitionStore(0, foreign=True)
                if ps.foreign:
                    local = sub & LOCAL_MASK
                    ps.cover(int(local.min()), int(local.max()) + 1)
                idx = ps.index_of(sub)
                if idx is None:  # covered above, or checked by _check_column_put
                    raise RuntimeError(f"unit {self.index}: rows of {partition!r} outside the index of home "
                                       f"{home} after their put was checked")
                i = idx.numpy()
                ps.batches.add(bid)
                mine = codes if pos is None else codes[pos.numpy()]
                for name in cols:
                    ps.column(name).numpy()[i] = mine
                if ps.foreign:
                    ps.exists.numpy()[i] = True
                    ps.ever.numpy()[i] = True
        self.used_bytes += nbytes
        return bid

    def _unstore(self, partition: str, bid: int, rows: torch.Tensor, new_rows: bool) -> None:
        batch = self.batches.pop(bid)
        self.used_bytes -= batch.nbytes
        for home, pos in ([(self.index, None)] if new_rows else self._groups(rows)):
            sub = rows if pos is None else rows[pos]
            ps = self._store_of(partition, home)
            if ps is None:
                continue
            ps.batches.discard(bid)
            idx = ps.index_of(sub)
            for name in batch.columns:
                ps.codes[name][idx] = -1
            if new_rows:
                ps.exists[idx] = False
                ps.ever[idx] = False
                ps.nrows -= sub.numel()
                self.used_rows -= sub.numel()
            elif ps.foreign:  # a foreign row is here while any of its cells is
                held = torch.stack([c[idx] >= 0 for c in ps.codes.values()]).any(0)
                ps.exists[idx] = held

    # ---- reads --------------------------------------------------------------------------

    async def rpc_get(self, partition: str, rows: Any, columns: Sequence[str]) -> dict[str, Any]:
        return self.read(partition, torch.as_tensor(ids_from_wire(rows, tensor=True), dtype=torch.long), columns)

    def read(self, partition: str, row_t: torch.Tensor, columns: Sequence[str]) -> dict[str, Any]:
        """``columns`` of the rows ``row_t`` (int64 ids), in that order, as wire columns. Never
        suspends: the controller's fused get_batch calls it directly when the unit is in its
        process, so a get_batch with rows ready is answered without a task."""
        if not self._holds(partition):
            if partition in self.dropped:
                raise RowsClearedError(f"partition {partition!r} was cleared; its rows cannot be read")
            raise UnknownPartitionError(f"storage unit {self.index} holds no partition {partition!r}")
        if not row_t.numel():
            raise BadPutError(f"get of no rows from partition {partition!r}")
        run = self._read_run(partition, row_t, columns)
        if run is not None:
            return {name: column_to_wire(col) for name, col in run.items()}
        parts = self._groups(row_t)
        if len(parts) == 1:
            out = self._read(partition, parts[0][0], row_t, columns)
        else:  # rows of several home units: read each, then back in the requested order
            # (with several parts every part has its positions: None stands for all rows)
            pieces = [(pos, self._read(partition, home, row_t[pos], columns)) for home, pos in parts
                      if pos is not None]
            order = torch.cat([pos for pos, _ in pieces])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel())
            inv = inverse.tolist()
            out = {name: concat([p[name] for _, p in pieces]).take(inv) for name in columns}
        return {name: column_to_wire(col) for name, col in out.items()}

    def _read_run(self, partition: str, row_t: torch.Tensor, columns: Sequence[str]) -> dict[str, Column] | None:
        """The common read, cheaply: consecutive ascending ids of one home unit whose every
        column sits in order in one batch (rows read as they were put). Slices of the index
        instead of gathers; None when any of that does not hold (``_read`` then reads, or
        says what is missing). A cell's code is set once and only ever reset to -1, so
        codes that step by one from a valid first code are the rows' cells, all present."""
        # numpy views of the int64 tensors: a few us per check where torch ops cost tens.
        ids = row_t.numpy()
        n = ids.shape[0]
        first, last = int(ids[0]), int(ids[-1])
        if last - first != n - 1 or first >> UNIT_SHIFT != last >> UNIT_SHIFT:
            return None
        if n > 2 and not (np.diff(ids) == 1).all():
            return None
        ps = self._store_of(partition, first >> UNIT_SHIFT)
        if ps is None or any(c not in ps.codes for c in columns):
            return None
        a = (first & LOCAL_MASK) - ps.base
        if a < 0 or a + n > ps.size:
            return None
        codes = np.stack([ps.codes[c].numpy()[a:a + n] for c in columns])
        firsts = codes[:, 0].tolist()
        if min(firsts) < 0 or (n > 1 and not (np.diff(codes, axis=1) == 1).all()):
            return None
        return {name: self._run_view(name, code, n) for name, code in zip(columns, firsts)}

    def _run_view(self, name: str, code: int, n: int) -> Column:
        """``n`` rows of column ``name`` lying in order in one batch from ``code`` on: a view."""
        pos = code & _POS_MASK
        return self.batches[code >> _POS_BITS].columns[name].take(range(pos, pos + n))

    def _read(self, partition: str, home: int, row_t: torch.Tensor, columns: Sequence[str]) -> dict[str, Column]:
        ps = self._store_of(partition, home)
        idx = ps.index_of(row_t) if ps is not None else None
        if ps is None or idx is None or not bool(ps.exists[idx].all()):
            raise self._missing_error(partition, ps, row_t, idx)
        missing = [n for n in columns if n not in ps.codes]
        if missing:
            raise MissingColumnError(
                f"partition {partition!r} has no column {missing[0]!r} in unit {self.index} (it holds "
                f"{sorted(ps.codes)[:8]}); check the name, or put that column before reading it")
        # All columns' locations at once: one check for holes, one for contiguous runs.
        codes = torch.stack([ps.codes[n][idx] for n in columns])
        if bool((codes < 0).any()):
            name = columns[int(torch.nonzero((codes < 0).any(1))[0])]
            lacking = row_t[ps.codes[name][idx] < 0]
            raise MissingColumnError(
                f"partition {partition!r}: rows {lacking[:5].tolist()} have no column {name!r} yet in unit "
                f"{self.index}; read them after it is put, or ask get_meta for {name!r} so that only rows "
                "having it are handed out")
        n = row_t.numel()
        runs = (codes.diff(dim=1) == 1).all(1).tolist() if n > 1 else [True] * len(columns)
        firsts = codes[:, 0].tolist()
        out = {}
        for j, name in enumerate(columns):
            if runs[j]:  # one batch read as it was written: a view
                out[name] = self._run_view(name, firsts[j], n)
            else:
                out[name] = self._gather(name, codes[j])
        return out

    def _gather(self, name: str, codes: torch.Tensor) -> Column:
        """Rows at ``codes`` in order: views of runs concatenated, or one gather per batch and a reorder."""
        n = codes.numel()
        first = int(codes[0])
        bids = codes >> _POS_BITS
        pos = codes & _POS_MASK
        if bool((bids == bids[0]).all()):
            return self.batches[first >> _POS_BITS].columns[name].take(pos.tolist())
        # Rows in the requested order as runs (consecutive positions of one batch): each run is
        # a view and one concat copies them, with no gather. Rows streamed in one or a few at a
        # time (a rollout's) read this way; when runs are many more than batches (rows of a few
        # large puts, shuffled), one gather per batch and one reorder cost less.
        starts = [0, *torch.nonzero((bids.diff() != 0) | (pos.diff() != 1)).flatten().add_(1).tolist()]
        heads = codes[starts].tolist()
        if len(starts) <= _FEW_RUNS or len(starts) <= _RUNS_PER_BATCH * len({c >> _POS_BITS for c in heads}):
            stops = [*starts[1:], n]
            return concat([self._run_view(name, c, stop - start) for c, start, stop in zip(heads, starts, stops)])
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
        row_t = torch.as_tensor(ids_from_wire(rows, tensor=True), dtype=torch.long)
        if not row_t.numel():
            return
        for home, pos in self._groups(row_t):
            ps = self._store_of(partition, home)
            if ps is None:
                continue
            idx = ((row_t if pos is None else row_t[pos]) & LOCAL_MASK) - ps.base
            idx = idx[(idx >= 0) & (idx < ps.size)]
            idx = idx[ps.exists[idx]]
            for c in ps.codes.values():
                self._free_cells(ps, c[idx])
                c[idx] = -1
            ps.exists[idx] = False
            if not ps.foreign:
                ps.nrows -= idx.numel()
                self.used_rows -= idx.numel()
        self._signal_freed()

    async def rpc_drop_partition(self, partition: str) -> None:
        ps = self.parts.pop(partition, None)
        stores = [ps] if ps is not None else []
        stores += self.foreign.pop(partition, {}).values()
        self.dropped.add(partition)
        if not stores:
            return
        for st in stores:
            for bid in st.batches:
                b = self.batches.pop(bid, None)
                if b is not None:
                    self.used_bytes -= b.nbytes
        if ps is not None:
            self.used_rows -= ps.nrows
        self._signal_freed()

    async def rpc_stats(self) -> dict[str, Any]:
        """Rows and bytes held, and who wrote here: rows/bytes put by each writer's node."""
        foreign = sum(int(fs.exists.sum()) for per in self.foreign.values() for fs in per.values())
        return {"unit": self.index, "rows": self.used_rows, "bytes": self.used_bytes,
                "batches": len(self.batches), "partitions": len(self.parts.keys() | self.foreign.keys()),
                "foreign_rows": foreign,
                "put_rows_by_node": dict(self.put_rows_by_node),
                "put_bytes_by_node": dict(self.put_bytes_by_node)}
