"""Samplers: which of a task's ready rows form the next batch.

A sampler runs inside the controller. It sees the task's ready rows in the order they
became ready (an insertion-ordered dict used as an ordered set) and reads per-row
groups and token counts from the partition; it returns the chosen rows in batch
order, or None when no acceptable batch is ready yet. Its cost grows with the batch
(and, for grouped sampling, with the ready rows it looks at), never with the partition.

Samplers are named in requests (``"sequential"`` or ``{"name": "grpo_group",
"group_size": 8}``) because the controller may live in another process.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Mapping, Protocol

from .balance import karmarkar_karp


class RowInfo(Protocol):
    groups: dict[int, int]
    tokens: dict[int, int]


@dataclass
class Sample:
    rows: list[int]
    dp_parts: list[int]


class Sampler:
    def sample(self, ready: Mapping[int, None], batch_size: int, info: RowInfo, partial: bool = False,
               ended: bool = False) -> Sample | None:
        """Rows for one batch, or None. ``partial``: the caller accepts fewer rows now;
        ``ended``: no more rows will come, so whatever is left may go."""
        raise NotImplementedError


class SequentialSampler(Sampler):
    """Oldest ready rows first."""

    def sample(self, ready, batch_size, info, partial=False, ended=False):
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

    def sample(self, ready, batch_size, info, partial=False, ended=False):
        n = self.group_size
        if batch_size % n:
            raise ValueError(f"grpo_group sampler: batch_size {batch_size} is not a multiple of "
                             f"group_size {n}; ask for whole groups")
        if len(ready) < batch_size and not (partial or ended):
            return None
        need = batch_size // n
        groups = info.groups
        buckets: dict[int, list[int]] = {}
        done: list[int] = []
        for row in ready:
            g = groups.get(row)
            if g is None:
                raise ValueError(f"grpo_group sampler: row {row} has no group id; put rows with groups=[...]")
            b = buckets.setdefault(g, [])
            b.append(row)
            if len(b) == n:
                done.append(g)
                if len(done) == need:
                    break
        if len(done) == need:
            return Sample([r for g in done for r in buckets[g]], [])
        if partial and done and not ended:  # fewer rows now, but only whole groups
            return Sample([r for g in done for r in buckets[g]], [])
        if ended and ready:  # end of stream: whole groups first, then what is left
            whole = set(done)
            rows = [r for g in done for r in buckets[g]]
            rest = [r for g, b in buckets.items() if g not in whole for r in b]
            return Sample((rows + rest)[:batch_size], [])
        return None


class TokenBalancedSampler(Sampler):
    """Picks rows with an inner sampler, then orders them so that ``meta.chunk(dp_size)``
    gives every data-parallel rank the same row count and near-equal token totals
    (Karmarkar-Karp), so no rank waits for the one with the longest sequences."""

    def __init__(self, dp_size: int, group_size: int | None = None):
        if int(dp_size) < 1:
            raise ValueError(f"token_balanced sampler: dp_size must be >= 1, got {dp_size}")
        self.dp_size = int(dp_size)
        self.inner: Sampler = GroupSampler(group_size) if group_size else SequentialSampler()

    def sample(self, ready, batch_size, info, partial=False, ended=False):
        if batch_size % self.dp_size:
            raise ValueError(f"token_balanced sampler: batch_size {batch_size} is not a multiple of "
                             f"dp_size {self.dp_size}")
        got = self.inner.sample(ready, batch_size, info, partial, ended)
        if got is None:
            return None
        rows = got.rows
        k = self.dp_size
        if len(rows) % k:  # a drained tail: balance what divides, keep the rest on the last ranks
            return Sample(rows, [])
        tokens = info.tokens
        parts = karmarkar_karp([tokens.get(r, 0) for r in rows], k, equal_size=True)
        return Sample([rows[i] for p in parts for i in p], [len(p) for p in parts])


SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "sequential": SequentialSampler,
    "grpo_group": GroupSampler,
    "token_balanced": TokenBalancedSampler,
}


def register_sampler(name: str, factory: Callable[..., Sampler]) -> None:
    """Add a sampler; it must be registered in the process that runs the controller."""
    SAMPLERS[name] = factory


def build_sampler(spec: str | Mapping[str, Any] | None) -> Sampler:
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
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}")
    try:
        return SAMPLERS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"sampler {name!r}: bad options {kwargs}: {e}") from None
