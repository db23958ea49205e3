"""Waiting for a value that rank 0 puts in torchrun's TCPStore (the run key, the controller's address)."""
from __future__ import annotations

import time
from typing import Any


def wait_for_value(store: Any, key: str, timeout_s: float, who: str, what: str) -> bytes:
    """``store.get(key)`` once the key exists; TimeoutError naming ``who`` waited for ``what``."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who}: {what} did not appear in the TCPStore within {timeout_s:.0f}s "
                               "(rank 0 puts it there at start; did rank 0 start?)")
        time.sleep(0.05)
    value: bytes = store.get(key)
    return value
