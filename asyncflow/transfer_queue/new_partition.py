"""``NewPartition``: a put of new rows that also creates their partition, in one request.

The executor starts each step with a put of its prompts into a new partition; creating the
partition with that put (``put(..., create=NewPartition(close_at=n))``) saves the separate
``create_partition`` round trip a step. The storage unit hands it to the controller with the
rows' notification; the controller creates the partition first and undoes it if the write is
refused, so a refused put leaves no partition behind."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NewPartition"]


@dataclass(frozen=True)
class NewPartition:
    tasks: Sequence[str] = ()  # as create_partition's tasks
    close_at: int | None = None  # as create_partition's: it closes itself once it holds that many rows
