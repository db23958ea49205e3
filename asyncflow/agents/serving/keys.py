"""Per-episode API keys: each agent episode gets its own random key, valid until the episode
ends or its time limit passes. A request with no key, an unknown key or an expired one is
refused (401) before anything it sends is read or recorded."""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EpisodeKeys", "KEY_PREFIX"]

KEY_PREFIX = "af-ep-"


class EpisodeKeys:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[Any, float]] = {}  # key -> (session, expiry on clock)

    def issue(self, session: Any, ttl_s: float) -> str:
        """A new key for ``session``, valid for ``ttl_s`` seconds."""
        if ttl_s <= 0:
            raise ValueError(f"EpisodeKeys.issue: ttl_s must be > 0, got {ttl_s}")
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self._keys[key] = (session, self._clock() + ttl_s)
        return key

    def lookup(self, key: str | None) -> Any | None:
        """The session of a valid key; None for a missing, unknown, revoked or expired one."""
        if not key:
            return None
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return None
            if self._clock() >= entry[1]:
                del self._keys[key]
                return None
            return entry[0]

    def revoke(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
