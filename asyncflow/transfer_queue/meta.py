"""BatchMeta: which rows of which partition, and which columns, a batch is made of.

It is what the driver hands to workers and what get_meta returns: metadata only,
small enough to travel in a control message. The bytes stay in the storage units
until a worker calls ``get_data(meta)``.

A row lives in the unit named by its id (its *home*, where its first columns were
put). A column added later by a producer on another node may be stored in that
node's unit instead: ``locations`` then lists, for that column, the unit of each row.
Columns absent from ``locations`` are at the rows' home units.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..cpu_account import charged

# A row's global index holds the storage unit that stores it in its high bits, so a
# client routes a read without asking the controller.
UNIT_SHIFT = 40
LOCAL_MASK = (1 << UNIT_SHIFT) - 1
MAX_UNITS = 1 << 16


def unit_of(row: int) -> int:
    return row >> UNIT_SHIFT


def make_row_id(unit: int, local: int) -> int:
    return (unit << UNIT_SHIFT) | local


def ids_to_wire(ids: Sequence[int]) -> Any:
    """Lists of ints travel as one int64 tensor frame: far cheaper than JSON numbers."""
    if not len(ids):
        return []
    return torch.from_numpy(np.array(ids, dtype=np.int64))  # numpy converts a list of ints faster than torch


def ids_from_wire(x: Any, tensor: bool = False) -> Any:
    """A list of ints (or, with ``tensor``, whatever is cheapest: a tensor stays a tensor)."""
    if hasattr(x, "tolist"):
        return x if tensor else x.numpy().tolist()
    if x is None:
        return []
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise ValueError(f"expected a list of integer ids, got {type(x).__name__}")
    return list(x)


def positions_by_unit(rows: Sequence[int]) -> dict[int, list[int]]:
    if rows and unit_of(min(rows)) == unit_of(max(rows)):  # one unit: skip the per-row walk
        return {unit_of(rows[0]): list(range(len(rows)))}
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        out.setdefault(unit_of(r), []).append(i)
    return out


# A read request to one unit: (unit, positions in the meta, column names).
ReadRequest = tuple[int, list[int], list[str]]


def plan_reads(meta: BatchMeta, names: Sequence[str]) -> list[ReadRequest]:
    """Read requests by unit for ``names`` of the meta's rows; columns whose cells sit on
    the same units travel together. Shared by the clients and the controller's fused get."""
    by_layout: dict[Any, list[str]] = {}
    for c in names:
        units = meta.locations.get(c)
        by_layout.setdefault(None if units is None else tuple(units), []).append(c)
    out: list[ReadRequest] = []
    for layout, cols in by_layout.items():
        if layout is None:
            by_unit = positions_by_unit(meta.rows)
        else:
            by_unit = {}
            for i, u in enumerate(layout):
                by_unit.setdefault(u, []).append(i)
        out += [(u, pos, cols) for u, pos in by_unit.items()]
    return out


@dataclass
class BatchMeta:
    partition: str
    rows: list[int]  # global row indexes, in batch order
    columns: list[str]
    groups: list[int] = field(default_factory=list)  # group id per row (GRPO: one per prompt)
    tokens: list[int] = field(default_factory=list)  # tokens per row (sum over jagged columns)
    end_of_stream: bool = False  # no rows left for this task in this partition
    dp_parts: list[int] = field(default_factory=list)  # rows per data-parallel part, when split
    locations: dict[str, list[int]] = field(default_factory=dict)  # column -> unit per row, off-home only

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def size(self) -> int:
        return len(self.rows)

    def select(self, idx: Sequence[int], columns: Sequence[str] | None = None) -> BatchMeta:
        return replace(
            self,
            rows=[self.rows[i] for i in idx],
            groups=[self.groups[i] for i in idx] if self.groups else [],
            tokens=[self.tokens[i] for i in idx] if self.tokens else [],
            columns=list(columns) if columns is not None else list(self.columns),
            end_of_stream=False,
            dp_parts=[],
            locations={c: [units[i] for i in idx] for c, units in self.locations.items()},
        )

    def with_columns(self, columns: Sequence[str]) -> BatchMeta:
        return replace(self, columns=list(columns))

    def unit_of_column(self, column: str) -> list[int]:
        """The storage unit of each row's ``column``, in row order."""
        units = self.locations.get(column)
        return list(units) if units is not None else [unit_of(r) for r in self.rows]

    def stored_at(self, columns: Sequence[str], unit: int) -> BatchMeta:
        """This meta after ``columns`` of all its rows were written to ``unit``."""
        locations = {c: u for c, u in self.locations.items() if c not in columns}
        if any(unit_of(r) != unit for r in self.rows):
            locations.update({c: [unit] * len(self.rows) for c in columns})
        return replace(self, locations=locations)

    def part_sizes(self, n: int) -> list[int]:
        """Rows in each of ``n`` parts: the sampler's data-parallel split when it made one,
        else contiguous parts of near-equal row count."""
        if n < 1:
            raise ValueError(f"cannot split a batch into {n} parts")
        if self.dp_parts and len(self.dp_parts) == n:
            return list(self.dp_parts)
        q, r = divmod(len(self.rows), n)
        return [q + (1 if i < r else 0) for i in range(n)]

    def chunk(self, n: int) -> list[BatchMeta]:
        """Split into ``n`` contiguous parts (``part_sizes``)."""
        out, start = [], 0
        for s in self.part_sizes(n):
            out.append(self.select(range(start, start + s)))
            start += s
        return out

    def part(self, n: int, i: int) -> BatchMeta:
        """Part ``i`` of ``chunk(n)`` alone: a data-parallel rank builds its own share, not all
        ``n`` (with hundreds of ranks, every rank building every share costs ranks x rows)."""
        sizes = self.part_sizes(n)
        if not 0 <= i < n:
            raise IndexError(f"part {i} of a batch split into {n} parts")
        start = sum(sizes[:i])
        return self.select(range(start, start + sizes[i]))

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        if not metas:
            raise ValueError("concat of no BatchMeta")
        parts = {m.partition for m in metas}
        if len(parts) != 1:
            raise ValueError(f"cannot concat batches of different partitions {sorted(parts)}")
        first = metas[0]
        return BatchMeta(
            partition=first.partition,
            rows=[r for m in metas for r in m.rows],
            columns=list(first.columns),
            groups=[g for m in metas for g in m.groups] if all(m.groups for m in metas) else [],
            tokens=[t for m in metas for t in m.tokens] if all(m.tokens for m in metas) else [],
            locations={c: [u for m in metas for u in m.unit_of_column(c)]
                       for c in sorted({c for m in metas for c in m.locations})},
        )

    @charged("serialization")
    def to_wire(self) -> dict[str, Any]:
        return {
            "partition": self.partition, "rows": ids_to_wire(self.rows), "columns": self.columns,
            "groups": ids_to_wire(self.groups), "tokens": ids_to_wire(self.tokens),
            "end_of_stream": self.end_of_stream, "dp_parts": self.dp_parts,
            **({"locations": {c: ids_to_wire(u) for c, u in self.locations.items()}} if self.locations else {}),
        }

    @staticmethod
    @charged("serialization")
    def from_wire(w: dict[str, Any]) -> BatchMeta:
        return BatchMeta(
            partition=w["partition"], rows=ids_from_wire(w["rows"]), columns=list(w["columns"]),
            groups=ids_from_wire(w.get("groups")), tokens=ids_from_wire(w.get("tokens")),
            end_of_stream=bool(w.get("end_of_stream", False)), dp_parts=list(w.get("dp_parts") or []),
            locations={c: ids_from_wire(u) for c, u in (w.get("locations") or {}).items()},
        )
