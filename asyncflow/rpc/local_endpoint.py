"""``LocalEndpoint``: calls a service in this event loop directly, with ``RpcClient``'s signature
(the in-process default)."""
from __future__ import annotations

import asyncio
from typing import Any

from .errors import RpcTimeout


class LocalEndpoint:
    """Same call signature as RpcClient, for a service living in this event loop."""

    def __init__(self, service: Any, name: str = "local", *, timeout_error: type[RpcTimeout] = RpcTimeout):
        self.service = service
        self.address = name
        self.timeout_error = timeout_error  # raised for a call that runs past its _timeout

    async def call(self, method: str, /, _timeout: float | None = None, **args: Any) -> Any:
        fn = getattr(self.service, f"rpc_{method}")
        if _timeout is None:
            return await fn(**args)
        try:
            # wait_for, not asyncio.timeout: a caller may be an RpcServer handler still in its
            # eager first step, outside any Task, where asyncio.timeout cannot work.
            return await asyncio.wait_for(fn(**args), _timeout)
        except TimeoutError:
            raise self.timeout_error(f"{method} on {self.address} took longer than {_timeout:.1f}s") from None

    async def close(self) -> None:
        pass
