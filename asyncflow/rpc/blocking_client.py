"""``BlockingRpcClient``: the same calls as ``RpcClient`` without an event loop, for synchronous
worker code; a socket per calling thread."""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import zmq

from ..cpu_account import charged
from . import auth, codec
from .client_replies import check_reply, decode_reply, no_reply_hint, raise_remote
from .errors import RpcTimeout


class BlockingRpcClient:
    """The blocking twin of :class:`RpcClient`, for synchronous worker code.

    A blocking socket wakes the caller straight from libzmq; an event loop on a helper
    thread adds a thread hop and a loop wake-up to every call, a large share of a put's
    time. Each calling thread gets its own
    socket (ZMQ sockets are not thread-safe), so threads never wait for each other.
    ``send``/``recv`` split a call so one thread can have requests to several units in
    flight at once.
    """

    def __init__(self, address: str, ctx: zmq.Context[Any], timeout: float = 60.0, *, key: bytes | None = None,
                 timeout_error: type[RpcTimeout] = RpcTimeout):
        self.address = address
        self.timeout = timeout
        self.timeout_error = timeout_error  # raised for a call with no reply in time
        self._ctx = ctx
        self._key = key if key is not None else auth.run_key()
        self._ids = itertools.count()
        self._local = threading.local()
        self._sockets: list[Any] = []
        self._sockets_lock = threading.Lock()
        self.auth = auth.FailureLog(f"client of {address}")

    @property
    def auth_failures(self) -> int:
        return self.auth.count

    def _state(self) -> Any:
        """This thread's socket and its bookkeeping (a threading.local), made on first use."""
        st = self._local
        if not hasattr(st, "sock"):
            st.sock = self._ctx.socket(zmq.DEALER)
            st.sock.setsockopt(zmq.LINGER, 0)
            st.sock.connect(self.address)
            st.sender = auth.new_sender_id()  # one MAC sender per socket
            st.outstanding = set()
            st.early = {}  # replies that arrived while this thread waited for another id
            with self._sockets_lock:
                self._sockets.append(st.sock)
        return st

    @charged("rpc")
    def send(self, method: str, /, **args: Any) -> tuple[int, str]:
        st = self._state()
        rid = next(self._ids)
        frames = codec.encode({"id": rid, "m": method, "a": args})
        st.sock.send_multipart(auth.seal(auth.REQUEST, auth.nonce_of(st.sender, rid), frames, self._key), copy=False)
        st.outstanding.add(rid)
        return rid, method

    @charged("rpc")
    def recv(self, ticket: tuple[int, str], timeout: float | None = None) -> Any:
        rid, method = ticket
        st = self._state()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while rid not in st.early:
                left = deadline - time.monotonic()
                if left <= 0 or not st.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    raise self.timeout_error(f"no reply to {method} from {self.address} within "
                                             f"{timeout:.1f}s: {no_reply_hint(self.address)}")
                frames = st.sock.recv_multipart(copy=False)
                opened = check_reply(self, st.sender, frames)
                if opened is None or opened[0] not in st.outstanding:  # a late reply to a timed-out call
                    continue
                gid, body = opened
                msg = decode_reply(self, gid, body)
                if msg is not None:
                    st.early[gid] = msg
            msg = st.early.pop(rid)
        finally:
            st.outstanding.discard(rid)
        if "e" in msg:
            raise_remote(self.address, method, msg["e"])
        return msg.get("r")

    def call(self, method: str, /, _timeout: float | None = None, **args: Any) -> Any:
        return self.recv(self.send(method, **args), _timeout)

    def close(self) -> None:
        with self._sockets_lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()
