"""``LocalEndpoint``: calls a service in this event loop directly, with ``RpcClient``'s signature
(the in-process default)."""
from __future__ import annotations

from typing import Any

from .errors import RpcTimeout
from .waits import wait_within


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
            # not asyncio.timeout: a caller may be an RpcServer handler still in its eager first
            # step, outside any Task, where asyncio.timeout cannot work; not wait_for, which can
            # drop the caller's cancellation (rpc/waits.py)
            return await wait_within(fn(**args), _timeout)
        except TimeoutError:
            raise self.timeout_error(f"{method} on {self.address} took longer than {_timeout:.1f}s") from None

    async def close(self) -> None:
        pass
