"""What both RPC servers share: the service, a bound ROUTER socket, the key and the counters,
and the steps a request goes through (tag check, decoding, method lookup, the reply)."""
from __future__ import annotations

import logging
import traceback
from typing import Any

import zmq

from ..cpu_account import count
from . import auth, codec

log = logging.getLogger(__name__)


def _bind(sock: Any, address: str) -> str:
    """Bind a ROUTER socket; ``tcp://HOST:0`` picks a free port on that interface only."""
    sock.setsockopt(zmq.LINGER, 0)
    if address.endswith(":0"):
        host = address.rsplit(":", 1)[0]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(address)
    return address


def check_request(server: Any, frames: list[Any]) -> tuple[bytes, list[Any]] | None:
    """``(nonce, [header, *buffers])`` of a request whose tag is valid under the server's key
    and whose nonce is new; else None, counted and logged (rate-limited). Runs before any
    byte of the message is decoded."""
    opened = auth.unseal(auth.REQUEST, frames, server._key)
    if opened is None:
        server.auth.dropped("bad or missing tag")
        return None
    if not server._replays.accept(opened[0]):
        server.auth.dropped("replayed message")
        return None
    return opened


def parse_request(server: Any, frames: list[Any]) -> tuple[Any, str, Any, dict[str, Any]] | None:
    """(request id, method name, bound method or None, args), or None for a message that
    is dropped and counted: an undecodable message never reaches a method. ``frames`` has
    passed the tag check."""
    try:
        msg = codec.decode(frames)
        rid, method, args = msg["id"], msg["m"], msg.get("a") or {}
    except Exception as e:  # noqa: BLE001 - any decoding failure: the message is counted, logged and dropped
        server.bad_messages += 1
        log.warning("%s: dropped a malformed message: %s", server.name, e)
        return None
    fn = getattr(server.service, f"rpc_{method}", None) if isinstance(method, str) else None
    count(f"{server.name}:{method}")
    return rid, method, fn, args


def open_request(server: Any, frames: list[Any]) -> tuple[bytes, tuple[Any, str, Any, dict[str, Any]]] | None:
    """A received message (identity frame first) checked and parsed: (nonce, (id, method, handler,
    args)), or None when it was refused (each refusal is handled where check or parse found it)."""
    opened = check_request(server, frames[1:])
    if opened is None:
        return None
    nonce, body = opened
    req = parse_request(server, body)
    return None if req is None else (nonce, req)


def no_method(server: Any, method: Any) -> ValueError:
    return ValueError(f"{server.name} has no method {method!r}")


def error_reply(rid: Any, e: BaseException) -> dict[str, Any]:
    return {"id": rid, "e": {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}}


def encode_reply(reply: dict[str, Any]) -> list[Any]:
    try:
        return codec.encode(reply)
    except codec.CodecError as e:  # a result that cannot travel is the caller's error, not a hang
        return codec.encode({"id": reply["id"], "e": {"type": "RemoteError", "msg": str(e), "tb": ""}})


class ServerBase:
    """What both servers hold: the service, a bound ROUTER socket, the key and the counters."""

    def __init__(self, service: Any, address: str, ctx: Any, name: str, key: bytes | None):
        self.service = service
        self.name = name
        self._key = key if key is not None else auth.run_key()
        # A plain socket even from a zmq.asyncio context: RpcServer's loop watches its fd itself.
        self._sock = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        self.address = _bind(self._sock, address)
        self.bad_messages = 0  # authentic but undecodable
        self.auth = auth.FailureLog(name)
        self._replays = auth.ReplayWindow()

    @property
    def auth_failures(self) -> int:
        return self.auth.count
