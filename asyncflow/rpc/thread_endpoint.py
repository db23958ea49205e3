"""``ThreadEndpoint``: calls a service that runs on another event loop of this process (an
``EventLoopThread``), with ``RpcClient``'s signature and what a caller sees over the wire, but
no socket, no tag and no frames.

What stays as over the wire: arguments and replies are copied as encode-then-decode would
give them (``codec.copy_message``), so caller and service never share a tensor or a dict; a
value the codec refuses is refused here too; an error reaches the caller as ``RpcClient``
raises it (the registered class, else ``RemoteError`` with the service's traceback). The call
runs on the service's loop, as a request would.

Services say where they run with ``serve_in_process(address, service, loop)`` (the
TransferQueue's in-process service does, for its controller and its units); a client asks
``in_process(address)`` before opening a socket to that address.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from . import codec
from .client_replies import raise_remote
from .errors import RpcTimeout
from .server_base import error_reply
from .waits import wait_within

_SERVICES: dict[str, tuple[Any, asyncio.AbstractEventLoop]] = {}  # address -> (service, its loop)
_LOCK = threading.Lock()


def serve_in_process(address: str, service: Any, loop: asyncio.AbstractEventLoop) -> None:
    """``service`` (its ``rpc_*`` methods), served at ``address`` by ``loop``, may be called
    directly by clients of this process."""
    with _LOCK:
        _SERVICES[address] = (service, loop)


def withdraw(address: str) -> None:
    """The service at ``address`` stops: clients made from now on use the socket."""
    with _LOCK:
        _SERVICES.pop(address, None)


def in_process(address: str, timeout: float = 60.0, *,
               timeout_error: type[RpcTimeout] = RpcTimeout) -> ThreadEndpoint | None:
    """An endpoint calling the service at ``address`` directly (calls without a ``_timeout``
    wait ``timeout`` s), or None when it is not in this process."""
    with _LOCK:
        found = _SERVICES.get(address)
    return None if found is None else ThreadEndpoint(found[0], found[1], address, timeout, timeout_error=timeout_error)


class ThreadEndpoint:
    """Same call signature as RpcClient, for a service running on ``loop`` (another thread's,
    or this one's)."""

    def __init__(self, service: Any, loop: asyncio.AbstractEventLoop, address: str, timeout: float = 60.0, *,
                 timeout_error: type[RpcTimeout] = RpcTimeout):
        self.service = service
        self.loop = loop
        self.address = address
        self.timeout = timeout  # of a call without its own _timeout, as RpcClient's
        self.timeout_error = timeout_error  # raised for a call that runs past its _timeout

    async def call(self, method: str, /, _timeout: float | None = None, **args: Any) -> Any:
        fn = getattr(self.service, f"rpc_{method}", None)
        if fn is None:  # as a server refuses it
            raise ValueError(f"the service at {self.address} has no method {method!r}")
        sent = codec.copy_message(args)

        async def serve() -> Any:  # on the service's loop; the reply copied there, as encoded there
            try:
                result = await fn(**sent)
            except Exception as e:  # noqa: BLE001 - handed to the caller as a server replies it
                return error_reply(None, e)
            try:
                return {"r": codec.copy_message(result)}
            except codec.CodecError as e:  # as encode_reply: a result that cannot travel
                return {"e": {"type": "RemoteError", "msg": str(e), "tb": ""}}

        wait = self.timeout if _timeout is None else _timeout
        fut = asyncio.run_coroutine_threadsafe(serve(), self.loop)
        try:
            reply = await wait_within(asyncio.wrap_future(fut), wait)
        except TimeoutError:  # (a stopped loop never runs the call: this ends the wait)
            raise self.timeout_error(f"{method} on {self.address} got no reply within {wait:.1f}s") from None
        if "e" in reply:
            raise_remote(self.address, method, reply["e"])
        return reply["r"]

    async def close(self) -> None:
        pass
