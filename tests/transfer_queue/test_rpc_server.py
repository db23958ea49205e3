"""RpcServer runs a handler at once (on Python 3.12+ as an eager Task; on 3.11 by hand, given a
Task only when it suspends) and answers one that does not suspend at once: a handler
that waits never blocks the others, replies keep their order per peer when a peer's pipe
is full, and a handler's errors (before or after it suspends) come back as errors."""
from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import torch
import zmq
import zmq.asyncio

from asyncflow.rpc import auth, codec, server_base
from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.async_server import RpcServer
from asyncflow.rpc.errors import RemoteError
from asyncflow.rpc.loop_thread import EventLoopThread

WAIT_S = 5.0


class Service:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.tasks: dict[str, asyncio.Task | None] = {}
        self.cancelled = False

    async def rpc_fast(self, x: int) -> int:
        self.tasks["fast"] = asyncio.current_task()
        return x + 1

    async def rpc_slow(self, x: int) -> int:
        self.tasks["slow_before"] = asyncio.current_task()
        try:
            await asyncio.wait_for(self.release.wait(), WAIT_S)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.tasks["slow_after"] = asyncio.current_task()
        return x * 10

    async def rpc_fail_now(self) -> None:
        raise ValueError("refused at once")

    async def rpc_fail_later(self) -> None:
        await asyncio.sleep(0)
        raise LookupError("refused after a suspension")

    async def rpc_blob(self, i: int, nbytes: int) -> dict:
        return {"i": i, "data": torch.zeros(nbytes, dtype=torch.uint8)}


@pytest.fixture
def served(monkeypatch):
    loop = EventLoopThread("rpc-server-test")
    svc = Service()
    bind = server_base._bind

    def small_pipes(sock: zmq.Socket, address: str) -> str:
        # Before bind: a listener gives accepted connections the options it had when bound.
        # A pipe of one message and a small kernel buffer fill at once when a peer does not read.
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.SNDBUF, 1 << 16)
        return bind(sock, address)
    monkeypatch.setattr(server_base, "_bind", small_pipes)

    async def start() -> RpcServer:
        s = RpcServer(svc, "tcp://127.0.0.1:0", zmq.asyncio.Context.instance(), "rpc-test")
        s.start()
        return s
    srv = loop.run(start(), timeout=10)
    yield loop, srv, svc
    loop.run(srv.close(), timeout=10)
    loop.stop()


def _client(loop: EventLoopThread, srv: RpcServer) -> RpcClient:
    return RpcClient(srv.address, zmq.asyncio.Context.instance(), timeout=WAIT_S)


async def _slow_in_flight(c: RpcClient, srv: RpcServer, x: int) -> asyncio.Future:
    """A "slow" call, sent and seen suspended on the server (its handler now in a Task)."""
    slow = asyncio.ensure_future(c.call("slow", x=x))
    await asyncio.sleep(0.05)
    assert not slow.done()
    assert len(srv._inflight) == 1
    return slow


EAGER = sys.version_info >= (3, 12)  # Python 3.12+


def test_handler_that_does_not_suspend_is_answered_at_once(served):
    loop, srv, svc = served
    c = _client(loop, srv)
    assert loop.run(c.call("fast", x=1), timeout=10) == 2
    assert (svc.tasks["fast"] is not None) == EAGER  # 3.11: answered from the reader callback itself
    assert not srv._inflight  # no Task left to track: answered within the reader callback
    loop.run(c.close(), timeout=10)


def test_suspending_handler_does_not_block_a_fast_one(served):
    loop, srv, svc = served
    c = _client(loop, srv)

    async def scenario() -> tuple:
        slow = await _slow_in_flight(c, srv, 3)
        fast = await c.call("fast", x=5)
        assert not slow.done() and not svc.release.is_set()  # answered while slow still waits
        svc.release.set()
        return fast, await slow

    fast, slow = loop.run(scenario(), timeout=10)
    assert (fast, slow) == (6, 30)
    assert (svc.tasks["slow_before"] is not None) == EAGER  # ran eagerly until it waited ...
    assert svc.tasks["slow_after"] is not None  # ... then went on in a Task
    assert not srv._inflight
    loop.run(c.close(), timeout=10)


@pytest.mark.parametrize("method,exc,text", [("fail_now", ValueError, "refused at once"),
                                             ("fail_later", RemoteError, "refused after a suspension"),
                                             ("nope", ValueError, "no method 'nope'")])
def test_errors_before_and_after_a_suspension_come_back(served, method, exc, text):
    loop, srv, _ = served
    c = _client(loop, srv)
    with pytest.raises(exc, match=text):
        loop.run(c.call(method), timeout=10)
    assert loop.run(c.call("fast", x=0), timeout=10) == 1  # and it keeps serving
    loop.run(c.close(), timeout=10)


def test_close_cancels_a_suspended_handler(served):
    loop, srv, svc = served
    c = _client(loop, srv)

    async def scenario() -> None:
        call = await _slow_in_flight(c, srv, 1)
        await srv.close()
        call.cancel()

    loop.run(scenario(), timeout=10)
    assert svc.cancelled  # the cancellation reached the handler's own code
    loop.run(c.close(), timeout=10)


def _blob_caller(ctx: zmq.Context, srv, n: int, nbytes: int):
    """A raw peer with tiny receive buffers that sends ``n`` authentic ``blob`` calls (each
    reply ``nbytes``) without reading: its replies pile up at the server."""
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 1 << 16)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(srv.address)
    sender = auth.new_sender_id()
    for i in range(n):
        frames = codec.encode({"id": i, "m": "blob", "a": {"i": i, "nbytes": nbytes}})
        peer.send_multipart(auth.seal(auth.REQUEST, auth.nonce_of(sender, i), frames), copy=False)
    return peer


def test_replies_to_a_peer_that_does_not_read_wait_in_order(served):
    """With the peer's pipe full, replies wait in that peer's backlog and leave in order once
    it reads; meanwhile another peer is answered at once."""
    loop, srv, _ = served
    ctx = zmq.Context()
    n, nbytes = 40, 1 << 20
    try:
        slow_peer = _blob_caller(ctx, srv, n, nbytes)
        deadline = time.monotonic() + WAIT_S
        while not srv._backlog:  # 40 MB of replies cannot all fit in the pipes and kernel buffers
            assert time.monotonic() < deadline, "no reply was ever held back"
            time.sleep(0.01)
        other = _client(loop, srv)
        # the server still answers others; generous time, since it may still be taking the flood in
        assert loop.run(other.call("fast", _timeout=30.0, x=7), timeout=35) == 8
        loop.run(other.close(), timeout=10)
        got = []
        while len(got) < n:
            assert slow_peer.poll(int(WAIT_S * 1000), zmq.POLLIN), f"only {len(got)} of {n} replies came"
            opened = auth.unseal(auth.REPLY, slow_peer.recv_multipart(copy=False))
            assert opened is not None
            msg = codec.decode(opened[1])
            got.append(msg["r"]["i"])
            assert msg["r"]["data"].numel() == nbytes
        assert got == list(range(n))
        assert not srv._backlog
    finally:
        ctx.destroy(linger=0)


def test_a_peer_that_never_reads_holds_a_bounded_backlog(served):
    """Replies held for a peer that keeps calling without reading stop at the cap; the rest
    are dropped and counted, and other peers are still answered."""
    loop, srv, _ = served
    srv.max_backlog_per_peer = 3
    ctx = zmq.Context()
    try:
        peer = _blob_caller(ctx, srv, 40, 1 << 20)
        deadline = time.monotonic() + WAIT_S
        while srv.dropped_replies == 0:
            assert time.monotonic() < deadline, "no reply was dropped"
            time.sleep(0.01)

        async def held() -> list[int]:  # read on the server's loop, which changes the backlog
            return [len(q) for q in srv._backlog.values()]
        assert all(n <= 3 for n in loop.run(held(), timeout=10))
        other = _client(loop, srv)
        # the server still answers others; generous time, since it may still be taking the flood in
        assert loop.run(other.call("fast", _timeout=30.0, x=7), timeout=35) == 8
        loop.run(other.close(), timeout=10)
        assert not peer.closed  # still connected: the drops came from the cap, not a lost peer
    finally:
        ctx.destroy(linger=0)


def _call_once(service, method: str, **args):
    """Serve ``service`` on a fresh server and loop, call ``method`` once, close everything."""
    loop = EventLoopThread(f"rpc-server-{method}")

    async def scenario():
        srv = RpcServer(service, "tcp://127.0.0.1:0", zmq.asyncio.Context.instance(), f"rpc-{method}")
        srv.start()
        c = RpcClient(srv.address, zmq.asyncio.Context.instance(), timeout=WAIT_S)
        try:
            return await c.call(method, **args)
        finally:
            await c.close()
            await srv.close()

    try:
        return loop.run(scenario(), timeout=10)
    finally:
        loop.stop()


def test_a_handler_may_call_a_local_endpoint_with_a_timeout_in_its_eager_step():
    """LocalEndpoint.call(_timeout=...) works outside a Task (the handler's first step)."""
    from asyncflow.rpc.local_endpoint import LocalEndpoint

    class Inner:
        async def rpc_twice(self, x: int) -> int:
            return 2 * x

    class Outer:
        def __init__(self) -> None:
            self.inner = LocalEndpoint(Inner(), "inner")

        async def rpc_call_inner(self, x: int) -> int:
            return await self.inner.call("twice", _timeout=WAIT_S, x=x)

    assert _call_once(Outer(), "call_inner", x=21) == 42


@pytest.mark.skipif(not EAGER, reason="Python 3.11 has no eager Tasks: a handler's first step runs outside a Task")
def test_a_handler_may_use_asyncio_timeouts_in_its_first_step():
    """From Python 3.12 asyncio.timeout and wait_for raise 'Timeout should be used inside a task'
    outside a Task: every handler of the TransferQueue's controller waits so (seen when the main
    job first ran on Python 3.12)."""
    class Timed:
        async def rpc_timed(self, x: int) -> int:
            async with asyncio.timeout(WAIT_S):
                await asyncio.sleep(0)
            return await asyncio.wait_for(asyncio.sleep(0, x + 1), WAIT_S)

    assert _call_once(Timed(), "timed", x=41) == 42


def test_an_event_loop_thread_stops_and_closes_its_loop():
    t = EventLoopThread("test-close")
    assert t.run(asyncio.sleep(0, result=7), timeout=5) == 7
    t.stop()
    assert t.loop.is_closed() and not t._thread.is_alive()
    t.stop()  # twice: nothing left to do

    busy = EventLoopThread("test-busy")
    release = threading.Event()
    busy.loop.call_soon_threadsafe(release.wait, 5)  # a callback that blocks the loop
    time.sleep(0.05)
    busy.stop(timeout_s=0.1)
    assert not busy.loop.is_closed()  # still running its callback: left open, not closed under it
    release.set()
    busy.stop()
    assert busy.loop.is_closed()
