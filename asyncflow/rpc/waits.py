"""``wait_within``: await something for at most a time, never losing the caller's cancellation.

On Python 3.11, ``asyncio.wait_for`` returns the inner result when the inner awaitable finishes
in the same loop round as the caller's task is cancelled: the cancellation is dropped there, and
the task runs on (its next wait, often a long one, then holds up whoever is tearing it down).
``wait_within`` waits with ``asyncio.wait`` instead: a cancellation always raises, and the inner
awaitable is cancelled with it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` seconds (None: no limit); TimeoutError after it,
    with ``aw`` cancelled. ``aw``: a coroutine (run as a Task) or a future."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)
    except asyncio.CancelledError:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        raise TimeoutError(f"no result within {timeout_s} s")
    return fut.result()
