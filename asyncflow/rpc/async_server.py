"""``RpcServer``: serves a service's ``rpc_*`` coroutines on a ROUTER socket, on the running
event loop, many calls in flight."""
from __future__ import annotations

import asyncio
import collections
import logging
import types
from typing import Any

import zmq

from ..cpu_account import charged, span
from . import auth
from .server_base import ServerBase, encode_reply, error_reply, no_method, open_request
from .sockets import EVENTS, POLLIN, drain, send_nowait, unwatch

log = logging.getLogger(__name__)


async def _cancel(tasks: list[Any]) -> None:
    """Cancel tasks and wait until they have ended, so none is destroyed while pending."""
    live = [t for t in tasks if t is not None and not t.done()]
    for t in live:
        t.cancel()
    if live:
        await asyncio.wait(live, timeout=5)


# From Python 3.12 asyncio.timeout and wait_for need the current Task: there a handler starts as an
# eager Task (run at once, up to its first suspension, as a Task). 3.11 has no eager Tasks: there
# the handler is started by hand and handed to a Task (_resume) when it first suspends.
_EAGER_TASK = getattr(asyncio, "eager_task_factory", None)


@types.coroutine
def _resume(coro: Any, yielded: Any) -> Any:
    """Drive on, inside a Task, a coroutine that was run by hand until it first suspended on
    ``yielded`` (a future): the Task waits for what the coroutine waits for, then resumes it
    (and throws cancellation into it), exactly as if the Task had run it from the start."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # noqa: BLE001 - cancellation goes into the coroutine
            try:
                yielded = coro.throw(e)
            except StopIteration as done:
                return done.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as done:
                return done.value


class RpcServer(ServerBase):
    """Serves ``rpc_*`` coroutines of ``service`` on a bound ROUTER socket, on the running loop.

    Like :class:`RpcClient`, with no zmq.asyncio on the hot path: the loop watches the
    socket's fd and one reader callback drains every request that has arrived. Each
    request's tag is checked (before anything is decoded), then its handler is run at
    once, by hand: a handler that finishes without suspending (most: a put, a get, a
    get_meta with rows ready) is answered right there, with no task and no loop round.
    Only a handler that really suspends (get_meta waiting for rows, a put waiting for
    room) is handed to a Task from the point where it suspended, so a waiting call never
    blocks the others. Replies are sent non-blocking; a reply its peer cannot take yet
    (its pipe is at the high-water mark) waits in that peer's backlog, in order.

    A handler's code up to its first suspension runs in the reader callback, outside any
    Task: ``asyncio.current_task()`` is None there (``asyncio.timeout`` needs a Task; use
    ``asyncio.wait_for``).
    """

    def __init__(self, service: Any, address: str, ctx: zmq.Context[Any], name: str, *,
                 key: bytes | None = None):
        super().__init__(service, address, ctx, name, key)
        # Without it a ROUTER drops a reply silently when the peer's pipe is full; with it the
        # send says so (zmq.Again) and the reply waits in the backlog.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        self._backlog: dict[bytes, collections.deque[Any]] = {}  # peer -> replies not yet taken, in order
        # A peer that keeps calling but never reads must not grow the server's memory without
        # bound: past this many held replies, its new ones are dropped (its calls time out).
        self.max_backlog_per_peer = 256
        self.dropped_replies = 0
        self.backlog_retry_s = 0.005
        self._retry: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_events)
        self._loop.call_soon(self._on_events)  # requests that came before the reader was set

    # ---- requests ------------------------------------------------------------------------
    def _on_events(self) -> None:
        """The fd woke up: run every request that has arrived, send what waits for room."""
        sock = self._sock
        if sock.closed:
            return
        drain(sock, self._on_request, self.name, "request")
        if self._backlog and not sock.closed:
            self._flush()
            # A send, and EVENTS itself, may consume the fd's wake-up for a request that came
            # meanwhile or for room freed in a held peer's pipe: look for requests now, and
            # retry what is still held on a timer rather than wait for an event that may not come.
            if not sock.closed:
                assert self._loop is not None  # set by start(), before the reader can fire
                if sock.getsockopt(EVENTS) & POLLIN:
                    self._loop.call_soon(self._on_events)
                if self._backlog and self._retry is None:
                    self._retry = self._loop.call_later(self.backlog_retry_s, self._retry_backlog)

    def _retry_backlog(self) -> None:
        self._retry = None
        self._on_events()

    def _on_request(self, frames: list[Any]) -> None:
        # Checked here, in arrival order on the loop's thread: the replay window is not shared.
        with span("rpc"):
            opened = open_request(self, frames)
        if opened is None:
            return
        nonce, req = opened
        ident = frames[0].bytes
        rid, method, fn, args = req
        try:
            if fn is None:
                raise no_method(self, method)
            coro = fn(**args)
            if _EAGER_TASK is not None:
                t = _EAGER_TASK(self._loop, self._serve(ident, nonce, rid, coro), name=f"{self.name}-{method}")
                if not t.done():  # suspended: the Task answers when the handler returns
                    self._inflight.add(t)
                    t.add_done_callback(self._inflight.discard)
                    t.add_done_callback(lambda _: self._look_again())
                return
            yielded = coro.send(None)  # run it now, up to its first suspension
        except StopIteration as done:  # finished without suspending: answer at once
            self._reply(ident, nonce, {"id": rid, "r": done.value})
            return
        except Exception as e:  # noqa: BLE001 - the method's error goes back to the caller
            self._reply(ident, nonce, error_reply(rid, e))
            return
        assert self._loop is not None  # set by start(), before the reader can fire
        t = self._loop.create_task(self._finish(ident, nonce, rid, coro, yielded), name=f"{self.name}-{method}")
        self._inflight.add(t)
        t.add_done_callback(self._inflight.discard)

    async def _serve(self, ident: bytes, nonce: bytes, rid: Any, coro: Any) -> None:
        """A handler (or its rest) awaited in a Task; then its reply."""
        try:
            reply = {"id": rid, "r": await coro}
        except Exception as e:  # noqa: BLE001 - the method's error goes back to the caller
            reply = error_reply(rid, e)
        self._reply(ident, nonce, reply)

    async def _finish(self, ident: bytes, nonce: bytes, rid: Any, coro: Any, yielded: Any) -> None:
        """The rest of a handler that suspended (started by hand), in a Task; then its reply."""
        await self._serve(ident, nonce, rid, _resume(coro, yielded))
        self._look_again()

    def _look_again(self) -> None:
        # A send lets libzmq take in what its I/O thread signalled, and so may consume the fd's
        # wake-up for a request that came meanwhile: look now (the reader covers the rest).
        if not self._sock.closed and self._sock.getsockopt(EVENTS) & POLLIN:
            assert self._loop is not None  # set by start(), before the reader can fire
            self._loop.call_soon(self._on_events)

    # ---- replies -------------------------------------------------------------------------
    @charged("rpc")
    def _reply(self, ident: bytes, nonce: bytes, reply: dict[str, Any]) -> None:
        if self._sock.closed:
            return
        frames = [ident, *auth.seal(auth.REPLY, nonce, encode_reply(reply), self._key)]
        queue = self._backlog.get(ident)
        if queue is not None:  # earlier replies to this peer still wait: keep the order
            if len(queue) >= self.max_backlog_per_peer:
                self.dropped_replies += 1
                log.warning("%s: dropped reply %r to a peer holding %d unread replies (it calls but does "
                            "not read)", self.name, reply.get("id"), len(queue))
                return
            queue.append(frames)
        elif not self._send(frames):
            self._backlog[ident] = collections.deque([frames])

    def _send(self, frames: list[Any]) -> bool:
        """False when the peer's pipe is full (retried later); a reply to a peer that is gone
        is dropped, as a ROUTER does."""
        try:
            return send_nowait(self._sock, frames)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("%s: dropped a reply to a peer that has gone", self.name)
        return True

    def _flush(self) -> None:
        """Send backlogged replies, each peer's in order, as far as their pipes take them."""
        for ident in list(self._backlog):
            queue = self._backlog[ident]
            while queue and self._send(queue[0]):
                queue.popleft()
            if not queue:
                del self._backlog[ident]

    async def close(self) -> None:
        unwatch(self._loop, self._sock, self._fd)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        await _cancel(list(self._inflight))
        self._backlog.clear()
        self._sock.close(linger=0)
