"""What both RPC clients do with a reply: check its tag and sender, decode it, raise the error
it carries; and the hint that goes with a call that got no reply."""
from __future__ import annotations

import logging
from typing import Any

from . import auth, codec
from .errors import ERROR_TYPES, RemoteError

log = logging.getLogger(__name__)


def raise_remote(endpoint: str, method: str, err: dict[str, Any]) -> None:
    cls = ERROR_TYPES.get(err.get("type", ""), RemoteError)
    msg = err.get("msg", "")
    if cls is RemoteError:
        msg = f"{err.get('type')} in {method} at {endpoint}: {msg}\n--- remote traceback ---\n{err.get('tb', '')}"
    exc = cls(msg)
    if cls is not RemoteError and err.get("tb") and hasattr(exc, "add_note"):
        exc.add_note(f"--- remote traceback ({method} at {endpoint}) ---\n{err['tb']}")
    raise exc


def no_reply_hint(address: str) -> str:
    return (f"is the service at {address} alive, and does it run with this run's key? (a message "
            "with a wrong key is dropped without a reply; see the server's auth_failures)")


def check_reply(client: Any, sender: int, frames: list[Any]) -> tuple[int, list[Any]] | None:
    """``(request id, [header, *buffers])`` of a reply whose tag is valid and echoes a nonce
    of this client's socket; else None, counted. Nothing is decoded here."""
    opened = auth.unseal(auth.REPLY, frames, client._key)
    if opened is None:
        client.auth.dropped("reply with a bad or missing tag")
        return None
    got_sender, rid = auth.split_nonce(opened[0])
    if got_sender != sender:
        client.auth.dropped("reply to another sender's request")
        return None
    return rid, opened[1]


def decode_reply(client: Any, rid: int, frames: list[Any]) -> dict[str, Any] | None:
    try:
        msg: dict[str, Any] = codec.decode(frames)
        if msg["id"] != rid:  # the tag's nonce and the header must name the same request
            raise codec.CodecError(f"reply id {msg['id']!r} under the nonce of request {rid}")
        return msg
    except Exception as e:  # noqa: BLE001 - any decoding failure: the reply is logged and dropped
        log.warning("%s: dropped a malformed reply: %s", client.auth.name, e)
        return None
