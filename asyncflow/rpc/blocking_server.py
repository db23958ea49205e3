"""``BlockingRpcServer``: serves a service's ``rpc_*`` functions on the calling thread, one
request at a time, with no event loop."""
from __future__ import annotations

import logging
from typing import Any

import zmq

from ..cpu_account import span
from . import auth
from .server_base import ServerBase, encode_reply, error_reply, no_method, open_request

log = logging.getLogger(__name__)


class BlockingRpcServer(ServerBase):
    """The blocking twin of :class:`RpcServer`: serves ``rpc_*`` methods (plain functions)
    on the calling thread, one request at a time, in arrival order.

    Worker calls run torch code synchronously and in order, so a blocking loop on the
    worker's own thread is the natural server: a request wakes that thread straight from
    libzmq, with no event loop and no thread hop, so a small call's round trip is shorter
    than through RpcServer on a loop thread. Same protocol, so RpcClient talks to either.
    """

    def __init__(self, service: Any, address: str, ctx: zmq.Context[Any], name: str, *, key: bytes | None = None):
        super().__init__(service, address, ctx, name, key)
        self.stopping = False  # a handler sets it; the loop ends after that reply is sent

    def serve_forever(self) -> None:
        """Handle requests until a handler sets ``stopping``. Blocks without a timeout on
        purpose: an idle worker waits for work; its liveness is watched elsewhere."""
        while not self.stopping:
            frames = self._sock.recv_multipart(copy=False)
            with span("rpc"):
                opened = open_request(self, frames)
            if opened is None:
                continue
            nonce, req = opened
            rid, method, fn, args = req
            try:
                if fn is None:
                    raise no_method(self, method)
                reply = {"id": rid, "r": fn(**args)}
            except Exception as e:  # noqa: BLE001 - the method's error goes back to the caller
                reply = error_reply(rid, e)
            with span("rpc"):
                self._sock.send_multipart(
                    [frames[0].bytes, *auth.seal(auth.REPLY, nonce, encode_reply(reply), self._key)], copy=False)

    def listen_also(self, address: str) -> str | None:
        """Also take requests at ``address`` (e.g. an ``ipc://`` socket for processes on this
        host: cheaper than TCP loopback); the address, or None (logged) if it cannot be bound."""
        try:
            self._sock.bind(address)
            return address
        except zmq.ZMQError as e:
            log.warning("%s: cannot listen on %s too (%s); TCP only", self.name, address, e)
            return None

    def close(self) -> None:
        self._sock.close(linger=0)
