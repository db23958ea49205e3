"""``EventLoopThread``: an asyncio loop on a daemon thread, for sync code that hosts async
services."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class EventLoopThread:
    """An asyncio loop on a daemon thread, for sync code that hosts async services."""

    def __init__(self, name: str = "asyncflow-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and close it (its sockets' owners close those first). A loop whose
        thread is still busy after ``timeout_s`` is left running on its daemon thread, with a
        warning: the caller is shutting down and must go on."""
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("event loop thread %r did not stop within %.0f s (a callback still runs); left open",
                        self._thread.name, timeout_s)
            return
        self.loop.close()
