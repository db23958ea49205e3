"""Stragglers: a device's work in one call is slowed by a seeded random factor.

Each rank of a call draws a slowdown (lognormal, median 1) from a generator seeded by the run's
seed and the call's key, so every rank of a group computes the same draws without talking to
the others. A synchronous collective call (a forward or an update ending in an all-reduce)
lasts as long as its slowest rank's work: ``slowest`` is the factor every rank of it holds for.
The more ranks, the larger the expected maximum: this is one of the terms that make weak
scaling sub-linear.
"""
from __future__ import annotations

import random


def slowdowns(seed: int, key: str, ranks: int, sigma: float) -> list[float]:
    """The ``ranks`` draws of the call named ``key`` (rank ``r`` gets the ``r``-th)."""
    if sigma < 0:
        raise ValueError(f"straggler sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return [1.0] * ranks
    rng = random.Random(f"{seed}:{key}")  # a string seed is hashed with SHA-512: the same in every process
    return [rng.lognormvariate(0.0, sigma) for _ in range(ranks)]


def slowest(seed: int, key: str, ranks: int, sigma: float) -> float:
    """The factor a collective call of ``ranks`` ranks holds for: its slowest rank's."""
    return max(slowdowns(seed, key, max(ranks, 1), sigma))
