"""``RpcClient``: one persistent DEALER connection per server, calls multiplexed by id, on the
running event loop."""
from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..cpu_account import charged
from . import auth, codec
from .client_replies import check_reply, decode_reply, no_reply_hint, raise_remote
from .errors import RpcTimeout
from .sockets import EVENTS, POLLIN, POLLOUT, drain, send_nowait, unwatch
from .spin import poll_ready


@functools.lru_cache(maxsize=1024)
def _json_str(s: str) -> bytes:
    return json.dumps(s).encode()


def _mem_bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame.buffer if hasattr(frame, "buffer") else frame)


class RpcClient:
    """One persistent DEALER connection to one server; calls are multiplexed by id.

    The hot path has no task, no zmq.asyncio future and no timer per call: a call is
    encoded, sealed and sent at once (non-blocking: when the send queue is full the
    message waits in a backlog, in order, until the socket takes it), then waits on one
    future. The event loop watches the socket's file descriptor; one reader callback
    drains every reply that has arrived, checks its tag and hands it to its call by id.
    One timer per client, armed at the earliest deadline of the calls in flight, fails
    each overdue call with RpcTimeout (or the client's ``timeout_error``) naming the method and the address.

    ``call`` is the whole round trip. ``start``/``result`` split it, so a caller can have
    one call in flight on each of several clients and wait for all of them on their
    futures without a task per call (the driver's fan-out to a worker group).
    """

    def __init__(self, address: str, ctx: zmq.Context[Any], timeout: float = 60.0, *,
                 key: bytes | None = None, timeout_error: type[RpcTimeout] = RpcTimeout):
        self.address = address
        self.timeout = timeout
        self.timeout_error = timeout_error  # raised for a call with no reply in time
        self._key = key if key is not None else auth.run_key()
        # A plain socket even from a zmq.asyncio context: the loop watches its fd itself.
        self._sock = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._fd = self._sock.getsockopt(zmq.FD)
        # The request id is also the MAC nonce's counter; the sender id is this socket's.
        self._sender = auth.new_sender_id()
        self._ids = itertools.count()
        # request id -> its future, method, timeout, deadline
        self._pending: dict[int, tuple[asyncio.Future[Any], str, float, float]] = {}
        # (request id, frames) not yet taken by the socket
        self._backlog: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.auth = auth.FailureLog(f"client of {address}")

    @property
    def auth_failures(self) -> int:
        return self.auth.count

    @staticmethod
    def encode_args(args: dict[str, Any]) -> list[Any]:
        """The arguments of a call as codec frames, for :meth:`start`; the same frames may
        be given to several calls (to several clients), encoded once."""
        return codec.encode(args)

    def _watch(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._sock.closed:
                raise RuntimeError(f"the client of {self.address} is closed")
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            loop.add_reader(self._fd, self._on_events)
            self._loop, self._timer = loop, None
        return loop

    @charged("rpc")
    def start(self, method: str, args: list[Any], timeout: float | None = None) -> tuple[int, asyncio.Future[Any]]:
        """Send a call now; ``(request id, future)``. ``args`` are :meth:`encode_args` frames.
        The future gets the reply message (give it to :meth:`result`) or ``timeout_error``."""
        loop = self._watch()
        rid = next(self._ids)
        # The codec's header of {"id": rid, "m": method, "a": args}, byte for byte, around
        # the arguments' header: their tensor frames keep their indices.
        head = b'{"id":%d,"m":%b,"a":%b}' % (rid, _json_str(method), _mem_bytes(args[0]))
        frames = auth.seal(auth.REQUEST, auth.nonce_of(self._sender, rid), [head, *args[1:]], self._key)
        if self._backlog or not self._send(frames):
            self._backlog.append((rid, frames))
        # The bookkeeping after the send, while the server works: replies are only read on
        # this thread, by _on_events, so none can be missed meanwhile.
        timeout = self.timeout if timeout is None else timeout
        fut = loop.create_future()
        deadline = loop.time() + timeout
        self._pending[rid] = (fut, method, timeout, deadline)
        if self._timer is None or deadline < self._timer_at:
            self._arm(loop, deadline)
        # A send lets libzmq take in what its I/O thread signalled, and so may consume the fd's
        # wake-up for a reply that came meanwhile (or for room to send the backlog). And a
        # pipe announces a message on the fd only once a read found it empty: a fresh one
        # (after a (re)connect) never has. So look now, every time: the fd then covers the rest.
        events = self._sock.getsockopt(EVENTS)
        if events & POLLIN or (self._backlog and events & POLLOUT):
            self._on_events()
        return rid, fut

    @staticmethod
    @charged("rpc")
    def spin(clients: list[RpcClient], done: Callable[[], bool], budget_s: float) -> bool:
        """Busy-poll the sockets of ``clients`` (:func:`poll_ready`) and take in their replies
        at once, until ``done()`` or ``budget_s`` has passed; True when done. Blocks the event
        loop meanwhile: keep the budget to a few hundred microseconds."""
        deadline = time.perf_counter() + budget_s
        by_sock = {c._sock: c for c in clients if not c._sock.closed}
        items = [(sock, POLLIN) for sock in by_sock]
        while not done():
            left = deadline - time.perf_counter()
            if left <= 0 or not items:
                return False
            for sock, _ in poll_ready(items, left):
                by_sock[sock]._on_events()
        return True

    def result(self, method: str, msg: dict[str, Any]) -> Any:
        """The value of a reply message, or the remote error raised here."""
        if "e" in msg:
            raise_remote(self.address, method, msg["e"])
        return msg.get("r")

    async def call(self, method: str, /, _timeout: float | None = None, **args: Any) -> Any:
        rid, fut = self.start(method, codec.encode(args), _timeout)
        try:
            msg = await fut
        except asyncio.CancelledError:
            self.forget(rid)
            raise
        return self.result(method, msg)

    def forget(self, rid: int) -> None:
        """Stop waiting for a call (cancelled): cancel its future; a late reply is dropped."""
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[0].cancel()

    def fail_all(self, exc: BaseException) -> None:
        """Fail every call still waiting with ``exc`` (e.g. the server is known dead)."""
        pending, self._pending = self._pending, {}
        for fut, _, _, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    # ---- deadlines: one timer per client, at the earliest deadline in flight ------------
    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._sweep), when

    def _sweep(self) -> None:
        self._timer = None
        assert self._loop is not None  # the timer runs on the loop the client is bound to
        now = self._loop.time() + 1e-4  # call_at may fire a hair early
        first = None
        for rid, (fut, method, timeout, deadline) in list(self._pending.items()):
            if fut.done():  # cancelled by its caller
                del self._pending[rid]
            elif deadline <= now:
                del self._pending[rid]
                fut.set_exception(self.timeout_error(f"no reply to {method} from {self.address} within "
                                                     f"{timeout:.1f}s: {no_reply_hint(self.address)}"))
            elif first is None or deadline < first:
                first = deadline
        if first is not None:
            self._arm(self._loop, first)

    # ---- the socket ---------------------------------------------------------------------
    def _send(self, frames: list[Any]) -> bool:
        return send_nowait(self._sock, frames)

    @charged("rpc")
    def _on_events(self) -> None:
        """The socket's fd woke up: send what waits for room, hand every reply to its call."""
        sock = self._sock
        if sock.closed:
            return
        drain(sock, self._on_reply, self.auth.name, "reply")
        if self._backlog and not sock.closed:
            while self._backlog and sock.getsockopt(EVENTS) & POLLOUT:
                rid, frames = self._backlog[0]
                if rid in self._pending and not self._send(frames):
                    break
                self._backlog.popleft()
            if sock.getsockopt(EVENTS) & POLLIN:  # replies came while sending the backlog
                assert self._loop is not None  # the reader runs on the loop the client is bound to
                self._loop.call_soon(self._on_events)

    def _on_reply(self, frames: list[Any]) -> None:
        opened = check_reply(self, self._sender, frames)
        if opened is None:
            return
        rid, body = opened
        entry = self._pending.get(rid)
        if entry is None or entry[0].done():  # a late reply to a timed-out or cancelled call
            return
        msg = decode_reply(self, rid, body)
        if msg is None:  # malformed: dropped, the call goes on waiting (and times out)
            return
        del self._pending[rid]
        entry[0].set_result(msg)

    async def close(self) -> None:
        pending, self._pending = self._pending, {}
        for fut, _, _, _ in pending.values():
            fut.cancel()
        self._backlog.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        unwatch(self._loop, self._sock, self._fd)
        self._loop = None
        self._sock.close(linger=0)
