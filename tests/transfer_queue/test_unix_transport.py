"""The same-host transport (rpc.unix_transport): messages cut at any byte arrive whole, the RPC
servers and clients speak over it as over ZMQ (calls, large payloads written in pieces, a
busy-poll, a peer that has gone), and the TransferQueue serves over it."""
from __future__ import annotations

import asyncio
import random
import socket
import threading

import pytest
import torch
import zmq
import zmq.asyncio

from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.async_server import RpcServer
from asyncflow.rpc.blocking_client import BlockingRpcClient
from asyncflow.rpc.blocking_server import BlockingRpcServer
from asyncflow.rpc.errors import RpcTimeout
from asyncflow.rpc.loop_thread import EventLoopThread
from asyncflow.rpc.unix_transport import Stream, UnixDealer, UnixRouter, encode_frames, new_address
from asyncflow.single_controller.tq_units import TransferQueueLayout

WAIT_S = 10.0


def _frames(rng: random.Random) -> list[bytes]:
    sizes = [rng.choice([0, 1, 7, 300, 5000]) for _ in range(rng.randint(1, 5))]
    return [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]


def test_messages_cut_anywhere_arrive_whole_and_in_order():
    """The reader takes a message's bytes in whatever pieces the kernel gives: every message
    comes out whole, frame by frame, in order (empty frames too)."""
    rng = random.Random(0)
    msgs = [_frames(rng) for _ in range(60)]
    wire = b"".join(bytes(b) for m in msgs for b in encode_frames(m))
    a, b = socket.socketpair()
    reader, got = Stream(b, "test"), []
    at = 0
    while at < len(wire):
        n = rng.choice([1, 3, 17, 4096, 70_000])
        a.sendall(wire[at:at + n])
        at += n
        reader.read(lambda frames: got.append([f.bytes for f in frames]))
    assert got == msgs
    a.close()
    reader.read(got.append)
    assert reader.eof


class Service:
    async def rpc_echo(self, x):
        return x

    async def rpc_blob(self, n: int) -> dict:
        return {"t": torch.arange(n, dtype=torch.int64)}

    async def rpc_wait(self, s: float) -> str:
        await asyncio.sleep(s)
        return "late"


@pytest.fixture
def served():
    loop = EventLoopThread("unix-transport-test")

    async def start() -> RpcServer:
        s = RpcServer(Service(), new_address("test"), zmq.asyncio.Context.instance(), "unix-test")
        s.start()
        return s
    srv = loop.run(start(), timeout=WAIT_S)
    yield loop, srv
    loop.run(srv.close(), timeout=WAIT_S)
    loop.stop()


def test_calls_and_payloads_larger_than_the_sockets_buffers(served):
    """Blocking and async clients: arguments and replies of megabytes (written and read in
    pieces) come back equal; many calls in flight at once each get their own reply."""
    loop, srv = served
    assert srv.address.startswith("unix://@")
    c = BlockingRpcClient(srv.address, zmq.Context.instance(), timeout=WAIT_S)
    big = torch.arange(3_000_000)
    assert torch.equal(c.call("echo", x=big), big)
    assert torch.equal(c.call("blob", n=2_000_000)["t"], torch.arange(2_000_000))
    assert c.call("echo", x={"a": [1, "b"], "t": torch.ones(2)})["a"] == [1, "b"]

    async def many():
        ac = RpcClient(srv.address, zmq.asyncio.Context.instance(), timeout=WAIT_S)
        try:
            out = await asyncio.gather(*[ac.call("echo", x=i) for i in range(300)],
                                       ac.call("echo", x=torch.arange(4_000_000)))
        finally:
            await ac.close()
        return out
    client_loop = EventLoopThread("unix-transport-client")
    try:
        out = client_loop.run(many(), timeout=60)
    finally:
        client_loop.stop()
    assert out[:300] == list(range(300)) and torch.equal(out[300], torch.arange(4_000_000))
    c.close()


def test_busy_poll_sees_the_reply(served):
    """RpcClient.spin polls the transport's descriptor with zmq_poll, as it polls a ZMQ socket."""
    loop, srv = served

    async def spun():
        ac = RpcClient(srv.address, zmq.asyncio.Context.instance(), timeout=WAIT_S)
        try:
            rid, fut = ac.start("echo", ac.encode_args({"x": 7}))
            done = RpcClient.spin([ac], fut.done, 5.0)
            return done, ac.result("echo", await fut)
        finally:
            await ac.close()
    client_loop = EventLoopThread("unix-transport-spin")
    try:
        assert client_loop.run(spun(), timeout=WAIT_S) == (True, 7)
    finally:
        client_loop.stop()


def test_a_server_that_has_gone_leaves_calls_to_time_out(served):
    loop, srv = served
    c = BlockingRpcClient(srv.address, zmq.Context.instance(), timeout=WAIT_S)
    assert c.call("echo", x=1) == 1
    loop.run(srv.close(), timeout=WAIT_S)
    with pytest.raises(RpcTimeout, match="no reply to echo"):
        c.call("echo", x=2, _timeout=0.3)
    c.close()


def test_a_reply_to_a_client_that_left_is_dropped(served):
    """The client closes while its call runs: the server's reply finds no peer (EHOSTUNREACH,
    dropped as a ZMQ ROUTER drops it) and the server goes on serving others."""
    loop, srv = served
    d = UnixDealer()
    d.connect(srv.address)
    c = BlockingRpcClient(srv.address, zmq.Context.instance(), timeout=WAIT_S)
    ticket = c.send("wait", s=0.2)
    c.close()  # gone before the reply
    c2 = BlockingRpcClient(srv.address, zmq.Context.instance(), timeout=WAIT_S)
    assert c2.call("echo", x="still serving") == "still serving"
    assert ticket[1] == "wait"
    d.close()
    c2.close()


def test_blocking_server_over_the_transport():
    class Plain:
        def rpc_add(self, a: int, b: int) -> int:
            return a + b
    srv = BlockingRpcServer(Plain(), new_address("blocking"), zmq.Context.instance(), "blocking-test")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    c = BlockingRpcClient(srv.address, zmq.Context.instance(), timeout=WAIT_S)
    assert [c.call("add", a=i, b=1) for i in range(50)] == list(range(1, 51))
    assert srv.listen_also("ipc://@another") is None  # one address per unix server: said, not raised
    c.close()


def test_bad_addresses_are_refused_by_name():
    with pytest.raises(ValueError, match="must be 'unix://@<name>'"):
        UnixRouter().bind("unix:///tmp/a-file")
    with pytest.raises(ConnectionError, match="nothing listens at unix://@asyncflow-nobody"):
        UnixDealer().connect("unix://@asyncflow-nobody")
    r = UnixRouter()
    addr = r.bind(new_address("taken"))
    with pytest.raises(zmq.ZMQError, match="cannot listen at"):
        UnixRouter().bind(addr)
    r.close()


def test_the_transfer_queue_serves_over_it():
    """A TransferQueue service with transport=unix: a put, then its rows read back, through
    the blocking client (the workers') and the async one (the driver's)."""
    from asyncflow.transfer_queue import AsyncTransferQueueClient, TransferQueueClient, TransferQueueService
    from asyncflow.transfer_queue.service import TransferQueueConfig

    svc = TransferQueueService(TransferQueueConfig(transport="unix")).start_in_thread()
    try:
        assert svc.controller_address.startswith("unix://@")
        tq = TransferQueueClient(svc.controller_address, timeout=WAIT_S)
        tq.create_partition("p", ["t"])
        tq.put({"x": torch.arange(6.0), "r": [torch.ones(i + 1) for i in range(6)]}, "p")
        meta = tq.get_meta(["x", "r"], 6, "t", "p")
        cols = tq.get_columns(meta)
        assert len(meta) == 6 and cols["x"].data.tolist() == [0, 1, 2, 3, 4, 5]
        tq.close()

        async def stats():
            c = AsyncTransferQueueClient(svc.controller_address, timeout=WAIT_S)
            try:
                return await c.status("p")
            finally:
                await c.close()
        loop = EventLoopThread("unix-tq-client")
        try:
            assert loop.run(stats(), timeout=WAIT_S)
        finally:
            loop.stop()
    finally:
        svc.stop_in_thread()


def test_unix_transport_is_for_one_host():
    assert TransferQueueLayout(transport="unix").validate() == []
    (problem,) = TransferQueueLayout(transport="unix", storage_units="per_node").validate()
    assert "transport=unix reaches processes of one host only" in problem


def test_a_rank_on_another_node_is_refused_with_the_unix_transport():
    from asyncflow.single_controller.errors import LaunchError
    from asyncflow.single_controller.tq_units import start_for_rank
    from asyncflow.transfer_queue import locality

    class Store:
        def set(self, key: str, value: str) -> None:
            pass
    try:
        with pytest.raises(LaunchError, match="rank 3 is on node 1, and transfer_queue.transport=unix"):
            start_for_rank(TransferQueueLayout(transport="unix"), Store(), 3, 0, 1, "127.0.0.1", 5, driver=False)
    finally:
        locality.set_locality(None, None)
