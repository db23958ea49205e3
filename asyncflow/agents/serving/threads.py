"""A sync agent on a thread of its own, awaited from the event loop. Kept apart from agent.py
(which imports torch through the recorder) so that the agent process imports no torch: every
object an import leaves behind is walked again by each full garbage collection there."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["on_own_thread"]


def on_own_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` on a thread of its own: many agents block in their HTTP calls at once, more
    than a shared executor has threads (an agent queued there would spend its time limit waiting)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():  # the episode ended without it (time limit)
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def target() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the episode
            value, error = None, e
        loop.call_soon_threadsafe(settle, value, error)
    threading.Thread(target=target, name=f"agent-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut
