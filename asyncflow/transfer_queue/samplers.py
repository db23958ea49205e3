"""Samplers: which of a task's ready rows form the next batch.

A sampler runs inside the controller. It sees the task's ready rows in the order they
became ready (an insertion-ordered dict used as an ordered set) and reads per-row
groups and token counts from the partition; it returns the chosen rows in batch
order, or None when no acceptable batch is ready yet. Its cost grows with the batch,
never with the partition: grouped sampling reads an index of the ready rows by group
(``GroupIndex``), which the controller keeps in step with every change of them.

Samplers are named in requests (``"sequential"`` or ``{"name": "grpo_group",
"group_size": 8}``) because the controller may live in another process.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from .balance import karmarkar_karp


class RowInfo(Protocol):
    groups: dict[int, int]
    tokens: dict[int, int]


@dataclass
class Sample:
    rows: list[int]
    dp_parts: list[int]


class GroupIndex:
    """Ready rows by group, and the groups holding at least ``size`` of them in the order
    they got there (a FIFO of complete groups), so a grouped batch is taken from the FIFO
    instead of walking every ready row of the incomplete groups."""

    def __init__(self, size: int, group_of: Mapping[int, int]):
        self.size = size
        self.group_of = group_of  # the partition's row -> group id (read, never written here)
        self.members: dict[int, dict[int, None]] = {}  # group -> its ready rows, in ready order
        self.complete: dict[int, None] = {}  # groups with >= size ready rows, oldest first
        self.ungrouped: dict[int, None] = {}  # ready rows put without a group id (a caller's error)

    def add(self, rows: Iterable[int]) -> None:
        n, get, members = self.size, self.group_of.get, self.members
        for r in rows:
            g = get(r)
            if g is None:
                self.ungrouped[r] = None
                continue
            m = members.get(g)
            if m is None:
                m = members[g] = {}
            m[r] = None
            if len(m) == n:
                self.complete[g] = None

    def remove(self, rows: Iterable[int]) -> None:
        """Forget ``rows``; call before the partition forgets their groups (clear_rows)."""
        n, get, members = self.size, self.group_of.get, self.members
        for r in rows:
            g = get(r)
            m = None if g is None else members.get(g)
            if g is None or m is None or r not in m:
                self.ungrouped.pop(r, None)
                continue
            del m[r]
            if len(m) == n - 1:
                self.complete.pop(g, None)
            if not m:
                del members[g]

    def clear(self) -> None:
        self.members.clear()
        self.complete.clear()
        self.ungrouped.clear()


class ReadyRows(dict[int, None]):
    """A subscription's ready rows: an insertion-ordered set (row -> None) that samplers read
    as a Mapping. The controller changes it only through ``add`` and ``remove``, which keep
    the group indexes that grouped samplers asked for (``group_index``) in step."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.indexes: dict[int, GroupIndex] = {}  # group size -> index; empty unless grouped sampling ran

    def add(self, rows: Sequence[int] | Mapping[int, None]) -> None:
        """Make ``rows`` (not ready yet) ready, after the ones already ready."""
        self.update(rows if isinstance(rows, dict) else dict.fromkeys(rows))
        for ix in self.indexes.values():
            ix.add(rows)

    def remove(self, rows: Sequence[int]) -> None:
        """``rows`` are no longer ready (consumed or cleared); rows not ready are ignored."""
        if len(self) == len(rows) and self.keys() == set(rows):
            self.clear()  # a batch took every ready row (the common streaming case)
            for ix in self.indexes.values():
                ix.clear()
            return
        pop = self.pop
        for r in rows:
            pop(r, None)
        for ix in self.indexes.values():
            ix.remove(rows)

    def group_index(self, size: int, group_of: Mapping[int, int]) -> GroupIndex:
        """The index for groups of ``size``, built with one walk of the ready rows the first
        time a grouped sampler asks, then kept up to date by ``add`` and ``remove``."""
        ix = self.indexes.get(size)
        if ix is None or ix.group_of is not group_of:
            ix = self.indexes[size] = GroupIndex(size, group_of)
            ix.add(self)
        return ix


class Sampler:
    def sample(self, ready: Mapping[int, None], batch_size: int, info: RowInfo, partial: bool = False,
               ended: bool = False) -> Sample | None:
        """Rows for one batch, or None. ``partial``: the caller accepts fewer rows now;
        ``ended``: no more rows will come, so whatever is left may go."""
        raise NotImplementedError


class SequentialSampler(Sampler):
    """Oldest ready rows first."""

    def sample(self, ready: Mapping[int, None], batch_size: int, info: RowInfo, partial: bool = False,
               ended: bool = False) -> Sample | None:
        if len(ready) >= batch_size:
            return Sample(list(islice(ready, batch_size)), [])
        if (partial or ended) and ready:
            return Sample(list(ready), [])
        return None


class GroupSampler(Sampler):
    """Whole groups only (GRPO: the n responses of one prompt travel together).

    ``batch_size`` counts rows and must be a multiple of ``group_size``.
    """

    def __init__(self, group_size: int):
        if int(group_size) < 1:
            raise ValueError(f"grpo_group sampler: group_size must be >= 1, got {group_size}")
        self.group_size = int(group_size)

    def sample(self, ready: Mapping[int, None], batch_size: int, info: RowInfo, partial: bool = False,
               ended: bool = False) -> Sample | None:
        n = self.group_size
        if batch_size % n:
            raise ValueError(f"grpo_group sampler: batch_size {batch_size} is not a multiple of "
                             f"group_size {n}; ask for whole groups")
        if len(ready) < batch_size and not (partial or ended):
            return None
        need = batch_size // n
        # Ready rows handed over as a plain mapping (not the controller's) get a throwaway index.
        index = ready.group_index(n, info.groups) if isinstance(ready, ReadyRows) else None
        if index is None:
            index = GroupIndex(n, info.groups)
            index.add(ready)
        if index.ungrouped:
            row = next(iter(index.ungrouped))
            raise ValueError(f"grpo_group sampler: row {row} has no group id; put rows with groups=[...]")
        done = list(islice(index.complete, need))
        if len(done) == need or (partial and done and not ended):  # partial: fewer rows, whole groups
            return Sample([r for g in done for r in islice(index.members[g], n)], [])
        if ended and ready:  # end of stream: whole groups first, then what is left
            rows = [r for g in done for r in islice(index.members[g], n)]
            return Sample(rows + list(islice(self._rest(ready, index, set(done)), batch_size - len(rows))), [])
        return None

    @staticmethod
    def _rest(ready: Mapping[int, None], index: GroupIndex, taken: set[int]) -> Iterator[int]:
        """The rows of the groups not ``taken``, group by group, groups in the order of their
        oldest ready row. Lazy: the drain at end of stream walks only as far as it takes."""
        group_of, members = index.group_of, index.members
        for r in ready:
            g = group_of[r]
            if g not in taken:
                taken.add(g)
                yield from members[g]


class TokenBalancedSampler(Sampler):
    """Picks rows with an inner sampler, then orders them so that ``meta.chunk(dp_size)``
    gives every data-parallel rank near-equal token totals (Karmarkar-Karp), with the same
    row count whenever the batch divides, so no rank waits for the one with the longest
    sequences."""

    def __init__(self, dp_size: int, group_size: int | None = None):
        if int(dp_size) < 1:
            raise ValueError(f"token_balanced sampler: dp_size must be >= 1, got {dp_size}")
        self.dp_size = int(dp_size)
        self.inner: Sampler = GroupSampler(group_size) if group_size else SequentialSampler()

    def sample(self, ready: Mapping[int, None], batch_size: int, info: RowInfo, partial: bool = False,
               ended: bool = False) -> Sample | None:
        got = self.inner.sample(ready, batch_size, info, partial, ended)
        if got is None:
            return None
        rows = got.rows
        k = self.dp_size
        tokens = info.tokens
        # Equal row counts when they divide; otherwise (e.g. 3 groups of 3 rows over 2 ranks)
        # balanced tokens with counts that differ.
        parts = karmarkar_karp([tokens.get(r, 0) for r in rows], k, equal_size=len(rows) % k == 0)
        return Sample([rows[i] for p in parts for i in p], [len(p) for p in parts])


SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "sequential": SequentialSampler,
    "grpo_group": GroupSampler,
    "token_balanced": TokenBalancedSampler,
}


def register_sampler(name: str, factory: Callable[..., Sampler]) -> None:
    """Add a sampler; it must be registered in the process that runs the controller (a launched
    run's service imports the run's ``imports`` first: register it in one of those modules)."""
    SAMPLERS[name] = factory


# A sampler as a request names it: "sequential", or {"name": "grpo_group", "group_size": 8}.
SamplerSpec = str | Mapping[str, Any]


def build_sampler(spec: SamplerSpec | None) -> Sampler:
    if spec is None:
        spec = "sequential"
    if isinstance(spec, str):
        name, kwargs = spec, {}
    elif isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    else:
        raise ValueError(f"sampler must be a name or {{'name': ..., **options}}, got {spec!r}")
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}. A sampler is looked up in the "
                         "TransferQueue controller's process: register it in a module of the run's `imports` "
                         "(that process imports them too)")
    try:
        return SAMPLERS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"sampler {name!r}: bad options {kwargs}: {e}") from None
