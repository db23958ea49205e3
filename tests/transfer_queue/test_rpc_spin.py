"""Bounded busy-waiting for replies (transport.poll_ready, SpinPolicy, RpcClient.spin):
the spin never runs past its budget, returns as soon as a reply is there, and a reply that
comes later still reaches its call through the event loop."""
from __future__ import annotations

import asyncio
import threading
import time

import zmq

from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.blocking_server import BlockingRpcServer
from asyncflow.rpc.spin import SpinPolicy, poll_ready

SLACK_S = 0.05  # a descheduled thread on a loaded 2-core machine overshoots by a few ms at most


class Service:
    def rpc_echo(self, x: int) -> int:
        return x

    def rpc_slow(self, x: int, delay_s: float) -> int:
        time.sleep(delay_s)
        return x


def test_policy_spins_only_after_a_short_wait():
    p = SpinPolicy(200e-6)
    assert p.budget() == 0.0  # nothing known yet: sleep
    p.observe(100e-6)
    assert p.budget() == 200e-6
    p.observe(250e-6)  # a little above the budget: a wait that slept includes its wake-up
    assert p.budget() == 200e-6
    p.observe(0.01)  # a long call: stop spinning at once
    assert p.budget() == 0.0
    p.observe(50e-6)
    assert p.budget() == 200e-6
    p.observe(300e-6, spun=False)  # the spin ran out: the next wait sleeps, then spin again
    assert p.budget() == 0.0
    assert p.budget() == 200e-6
    p.observe(250e-6, spun=False)  # ran out again: back off longer (3 waits)
    assert [p.budget() for _ in range(4)] == [0.0, 0.0, 0.0, 200e-6]
    p.observe(100e-6, spun=True)  # a spin that got its reply resets the back-off
    p.observe(280e-6, spun=False)
    assert [p.budget() for _ in range(2)] == [0.0, 200e-6]
    for _ in range(20):  # replies just after the budget, for ever: at most one spin in MAX_SKIP + 1 waits
        p.observe(250e-6, spun=False)
    spins = 0
    for _ in range(2 * (SpinPolicy.MAX_SKIP + 1)):
        if p.budget():
            spins += 1
            p.observe(250e-6, spun=False)
        else:
            p.observe(250e-6)
    assert spins <= 2
    off = SpinPolicy(0.0)
    off.observe(0.0)
    assert off.budget() == 0.0


def test_poll_ready_never_exceeds_its_budget():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://spin-test")
        b.connect("inproc://spin-test")
        for budget in (0.0, 100e-6, 2e-3):
            t0 = time.perf_counter()
            assert poll_ready([(b, zmq.POLLIN)], budget) == []
            assert time.perf_counter() - t0 < budget + SLACK_S
        a.send(b"x")
        t0 = time.perf_counter()
        ready = poll_ready([(b, zmq.POLLIN)], 5.0)  # a message waits: back at once, not after 5 s
        assert [s for s, _ in ready] == [b] and time.perf_counter() - t0 < 1.0
        assert b.recv() == b"x"
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _serve(ctx: zmq.Context):
    srv = BlockingRpcServer(Service(), "tcp://127.0.0.1:0", ctx, "spin-test")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


def test_spin_takes_the_reply_or_falls_back_to_the_loop():
    ctx = zmq.Context()
    srv, thread = _serve(ctx)

    async def go() -> None:
        client = RpcClient(srv.address, ctx, timeout=10)
        try:
            assert await client.call("echo", x=0) == 0  # connected
            # A reply within the budget: the spin takes it in and the future is done.
            rid, fut = client.start("echo", RpcClient.encode_args({"x": 1}))
            assert RpcClient.spin([client], fut.done, 5.0)
            assert client.result("echo", fut.result()) == 1
            # A reply after the budget: the spin gives up on time; the loop delivers it later.
            rid, fut = client.start("slow", RpcClient.encode_args({"x": 2, "delay_s": 0.3}))
            t0 = time.perf_counter()
            assert not RpcClient.spin([client], fut.done, 1e-3)
            assert time.perf_counter() - t0 < 1e-3 + SLACK_S and not fut.done()
            assert client.result("slow", await asyncio.wait_for(fut, 5)) == 2
            # A call that never gets a reply still times out (the spin does not swallow it).
            rid, fut = client.start("slow", RpcClient.encode_args({"x": 3, "delay_s": 0.5}), 0.1)
            assert not RpcClient.spin([client], fut.done, 1e-3)
            try:
                await asyncio.wait_for(fut, 5)
                raise AssertionError("no timeout")
            except Exception as e:  # noqa: BLE001
                assert type(e).__name__ == "RpcTimeout"
            await asyncio.sleep(0.6)  # the slow call ends (its late reply is dropped)
            srv.stopping = True  # the server stops after the next reply
            assert await client.call("echo", x=4) == 4
        finally:
            await client.close()

    try:
        asyncio.run(go())
        thread.join(5)
        assert not thread.is_alive()
    finally:
        srv.close()
        ctx.destroy(linger=0)
