"""How sequences are packed end to end into rows, for a forward pass without padding (the
rollout engine's prefill, the training engine's padding-free micro-batches).

Attention kernels that take a mask (eager, SDPA) score a packed row's whole W x W block, so
rows are kept near ``row_tokens`` long; padding the rows to a common width costs whole
tokens, so they are kept near the same length.
"""
from __future__ import annotations

__all__ = ["pack_rows"]


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sequence indices per row, each row at most C = max(row_tokens, longest) tokens.

    First fit, longest first, into rows of capacity C decides how many rows are needed; the
    sequences are then dealt over that many rows longest first into the emptiest, which
    evens the rows out (a last row holding a small remainder would pad every other row to C),
    unless that makes the longest row longer than first fit's. ``row_tokens`` <= 0 or
    everything in one row: one row in the order given. Deterministic (ties keep input order).
    """
    if not lengths:
        return []
    cap = max(row_tokens, max(lengths))
    if row_tokens <= 0 or sum(lengths) <= cap:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    first_fit: list[list[int]] = []
    free: list[int] = []
    for i in order:
        r = next((r for r, room in enumerate(free) if lengths[i] <= room), None)
        if r is None:
            first_fit.append([])
            free.append(cap)
            r = len(free) - 1
        first_fit[r].append(i)
        free[r] -= lengths[i]
    dealt: list[list[int]] = [[] for _ in first_fit]
    fill = [0] * len(first_fit)
    for i in order:
        r = min(range(len(fill)), key=fill.__getitem__)
        dealt[r].append(i)
        fill[r] += lengths[i]
    return dealt if max(fill) <= cap - min(free) else first_fit
