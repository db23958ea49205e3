"""Token-balanced partitioning of rows across data-parallel ranks.

In synchronous data-parallel training every rank waits at the gradient
all-reduce for the slowest rank, and a rank's step time is roughly
proportional to the number of tokens it processes.  RL rollouts have a
long-tailed response-length distribution, so a naive contiguous split of a
batch can hand one rank several times the tokens of another, leaving the
rest idle.  The functions here split row indexes into ``k`` parts whose token
sums are as even as possible, so every rank finishes at about the same time.

Everything here is a pure function over plain integer lengths (standard
library only) so it can be used from the transfer queue, a trainer, or a
benchmark without pulling in torch.

* :func:`karmarkar_karp` - multi-way largest differencing method; the
  recommended balancer.
* :func:`greedy_partition` - LPT greedy baseline.
* :func:`contiguous_partition` - what you get with no balancing at all.
* :func:`imbalance` - max part sum / mean part sum (1.0 is perfect).
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Sequence
from typing import TypeAlias

__all__ = [
    "karmarkar_karp",
    "greedy_partition",
    "contiguous_partition",
    "imbalance",
]


def _check_k(k: int) -> int:
    if isinstance(k, bool):
        raise ValueError(f"k must be a positive integer (number of data-parallel ranks), got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(
            f"k must be a positive integer (number of data-parallel ranks), got {k!r} "
            f"of type {type(k).__name__}"
        ) from None
    if k < 1:
        raise ValueError(f"k must be >= 1 (number of data-parallel ranks), got {k}")
    return k


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out: list[int] = []
    for i, length in enumerate(lengths):
        # operator.index accepts int and int-like scalars (e.g. numpy ints) but
        # rejects floats, so fractional "token counts" fail loudly.
        if isinstance(length, bool):
            raise ValueError(
                f"lengths[{i}] must be a non-negative integer token count, got {length!r}"
            )
        try:
            value = operator.index(length)
        except TypeError:
            raise ValueError(
                f"lengths[{i}] must be a non-negative integer token count, got {length!r} "
                f"of type {type(length).__name__}; convert lengths to int first"
            ) from None
        if value < 0:
            raise ValueError(f"lengths[{i}] must be a non-negative token count, got {value}")
        out.append(value)
    return out


def _check_divisible(n: int, k: int) -> None:
    if n % k != 0:
        raise ValueError(
            f"cannot split {n} rows into {k} equal parts: batch size must be a multiple of "
            f"the data-parallel size (pad or drop rows, or pass equal_size=False)"
        )


# A partial solution is a list of k (sum, members) sets kept sorted by sum,
# largest first; its heap key is its spread (largest sum - smallest sum).
# Members are a tree (None = empty, int = one row, pair = union of two trees)
# so a merge is O(k) instead of copying every index list, which would make the
# whole run quadratic in the number of rows; trees are flattened once at the end.
_Tree: TypeAlias = "int | tuple[_Tree, _Tree] | None"
_Set = tuple[int, _Tree]


def _flatten(tree: _Tree) -> list[int]:
    out: list[int] = []
    stack = [tree]
    while stack:  # iterative: trees can be as deep as the number of merges
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def _union(a: _Tree, b: _Tree) -> _Tree:
    if a is None:
        return b
    if b is None:
        return a
    return (a, b)


def _spread(sets: list[_Set]) -> int:
    return sets[0][0] - sets[-1][0]


def _sort_sets(sets: list[_Set]) -> list[_Set]:
    # Sort on the sum only: member trees are not meaningfully comparable.
    return sorted(sets, key=lambda s: s[0], reverse=True)


def karmarkar_karp(
    lengths: Sequence[int], k: int, equal_size: bool = True, refine: bool = True
) -> list[list[int]]:
    """Split item indexes into ``k`` parts with balanced length sums.

    Multi-way largest differencing method (Karmarkar-Karp): keep a max-heap of
    partial solutions keyed by spread, repeatedly take the two with the largest
    spread and merge them so the biggest set of one is paired with the smallest
    set of the other.  Combining the two most uneven solutions lets their
    imbalances cancel, and the final spread is typically far smaller than what
    greedy assignment achieves.

    Args:
        lengths: non-negative token count of each row.
        k: number of parts (data-parallel ranks), ``>= 1``.
        equal_size: if True every part gets exactly ``len(lengths) // k`` rows
            (``len(lengths)`` must be divisible by ``k``); otherwise part sizes
            may differ and parts may be empty when ``k > len(lengths)``.
        refine: after differencing, repeatedly swap rows (or, when not
            ``equal_size``, move a row) from the heaviest part to a lighter one
            while that lowers the heaviest part.  Needed because equal-size KK
            gives each part exactly one row from each group of ``k`` rows of
            adjacent length, so it cannot pair one huge outlier with many short
            rows; on long-tailed batches the refinement brings the heaviest part
            close to the mean.  Set False for plain KK.

    Returns:
        ``k`` lists of indexes into ``lengths``, each sorted ascending; every
        index appears in exactly one list.  Parts are ordered by descending
        token sum.  Deterministic for a given input.

    Raises:
        ValueError: ``k < 1``, a length that is negative or not an integer, or
            ``equal_size`` with ``len(lengths)`` not a multiple of ``k``.
    """
    k = _check_k(k)
    values = _check_lengths(lengths)
    n = len(values)
    if equal_size:
        _check_divisible(n, k)
    if n == 0:
        return [[] for _ in range(k)]
    if k == 1:
        return [list(range(n))]

    # Stable sort by length so ties resolve by index, keeping output deterministic.
    order = sorted(range(n), key=lambda i: values[i])

    heap: list[tuple[int, int, list[_Set]]] = []
    if equal_size:
        # Seed with k items at a time: every merge pairs one set from each side,
        # so each final set receives exactly one item per seed -> n/k items each.
        for start in range(0, n, k):
            chunk = order[start : start + k]
            sets = _sort_sets([(values[i], i) for i in chunk])
            heap.append((-_spread(sets), start, sets))
    else:
        for pos, i in enumerate(order):
            sets = [(values[i], i)] + [(0, None)] * (k - 1)
            heap.append((-_spread(sets), pos, sets))
    heapq.heapify(heap)

    # Tie-breaker for equal spreads; continues past the seed ids so it stays unique.
    counter = n
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a is sorted descending, b reversed is ascending: largest meets smallest.
        merged = [(sa + sb, _union(ta, tb)) for (sa, ta), (sb, tb) in zip(a, reversed(b))]
        merged = _sort_sets(merged)
        heapq.heappush(heap, (-_spread(merged), counter, merged))
        counter += 1

    _, _, final = heap[0]
    parts = [_flatten(tree) for _, tree in final]
    if refine:
        _refine(values, parts, equal_size)
    parts.sort(key=lambda part: sum(values[i] for i in part), reverse=True)
    return [sorted(part) for part in parts]


def _best_exchange(
    values: list[int], heavy: list[int], light: list[int], gap: int, allow_move: bool
) -> tuple[int, int] | None:
    """Best row exchange between a heavier and a lighter part.

    Returns ``(position in heavy, position in light or -1 for a plain move)``
    whose transferred amount ``d`` satisfies ``0 < d < gap`` (so both parts end
    below the old heavy sum) with ``d`` as close as possible to ``gap / 2``, or
    None if no exchange helps.
    """
    light_sorted = sorted((values[j], pos) for pos, j in enumerate(light))
    light_vals = [v for v, _ in light_sorted]
    best: tuple[int, int] | None = None
    best_score = gap  # |gap - 2d| < gap  <=>  0 < d < gap
    for hpos, i in enumerate(heavy):
        a = values[i]
        if allow_move and abs(gap - 2 * a) < best_score:
            best, best_score = (hpos, -1), abs(gap - 2 * a)
        # Ideal partner b has a - b == gap / 2; check the neighbours of that point.
        at = bisect.bisect_left(light_vals, a - gap / 2)
        for lpos in (at - 1, at):
            if 0 <= lpos < len(light_vals):
                score = abs(gap - 2 * (a - light_vals[lpos]))
                if score < best_score:
                    best, best_score = (hpos, light_sorted[lpos][1]), score
    return best


def _refine(values: list[int], parts: list[list[int]], equal_size: bool) -> None:
    """Local search that lowers the heaviest part in place (see ``refine``).

    Each step strictly lowers the largest sum of the pair involved and keeps the
    other below the old maximum, so the sorted vector of part sums decreases
    lexicographically and the loop terminates; the round cap is only a guard.
    """
    sums = [sum(values[i] for i in part) for part in parts]
    for _ in range(4 * len(values) + 16):
        h = max(range(len(parts)), key=sums.__getitem__)
        improved = False
        for p in sorted(range(len(parts)), key=sums.__getitem__):
            gap = sums[h] - sums[p]
            if gap <= 1:
                break  # lighter parts are sorted first, so no later part helps either
            found = _best_exchange(values, parts[h], parts[p], gap, allow_move=not equal_size)
            if found is None:
                continue
            hpos, lpos = found
            i = parts[h].pop(hpos)
            d = values[i]
            if lpos >= 0:
                j = parts[p].pop(lpos)
                d -= values[j]
                parts[h].append(j)
            parts[p].append(i)
            sums[h] -= d
            sums[p] += d
            improved = True
            break
        if not improved:
            return


def greedy_partition(lengths: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """LPT greedy baseline: longest rows first, each to the lightest part with room.

    With ``equal_size=True`` a part stops accepting rows once it holds
    ``len(lengths) // k`` rows (``len(lengths)`` must be divisible by ``k``).
    Returns ``k`` ascending index lists, in part order (not sorted by sum).
    """
    k = _check_k(k)
    values = _check_lengths(lengths)
    n = len(values)
    if equal_size:
        _check_divisible(n, k)
    capacity = n // k if equal_size else n

    parts: list[list[int]] = [[] for _ in range(k)]
    # Heap of (sum, part id): ties go to the lowest part id.  A full part is
    # simply not pushed back, so it never receives another row.
    heap = [(0, p) for p in range(k)]
    for i in sorted(range(n), key=lambda i: (-values[i], i)):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < capacity:
            heapq.heappush(heap, (total + values[i], p))
    return [sorted(part) for part in parts]


def contiguous_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Naive split of rows into ``k`` contiguous chunks, ignoring lengths.

    This is the "no balancing" baseline.  Chunks are equal when ``k`` divides
    ``len(lengths)``; otherwise the first ``len(lengths) % k`` chunks get one
    extra row (like ``numpy.array_split``).
    """
    k = _check_k(k)
    n = len(_check_lengths(lengths))
    base, extra = divmod(n, k)
    parts: list[list[int]] = []
    start = 0
    for p in range(k):
        size = base + (1 if p < extra else 0)
        parts.append(list(range(start, start + size)))
        start += size
    return parts


def imbalance(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """Max part sum divided by mean part sum; 1.0 means perfectly balanced.

    This is the slowest rank's load relative to the average, i.e. roughly the
    step-time slowdown caused by imbalance.  Defined as 1.0 when the total is 0.
    """
    if len(parts) == 0:
        raise ValueError("parts must contain at least one part (got an empty list of parts)")
    values = _check_lengths(lengths)
    sums = [sum(values[i] for i in part) for part in parts]
    total = sum(sums)
    if total == 0:
        return 1.0
    return max(sums) / (total / len(sums))
