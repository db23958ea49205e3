"""Bounded busy-waiting for replies (spin.poll_ready, SpinPolicy, RpcClient.spin):
the spin never runs past its budget, returns as soon as a reply is there, and a reply that
comes later still reaches its call through the event loop.

Budgets are checked against an injected clock (each read advances it one step) and the
order of events (the spin gave up while the server still held the reply), never against
wall-clock time, which a loaded machine stretches at will."""
from __future__ import annotations

import asyncio
import threading
import types

import pytest
import zmq

from asyncflow.rpc import spin
from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.blocking_server import BlockingRpcServer
from asyncflow.rpc.errors import RpcTimeout
from asyncflow.rpc.spin import SpinPolicy, poll_ready

HOLD_S = 10  # a held reply is released by the test; this only bounds a broken test's hang


class StepClock:
    """A perf_counter stand-in: each read returns the current time, then advances it."""

    def __init__(self, step_s: float):
        self.now = 0.0
        self.step_s = step_s

    def perf_counter(self) -> float:
        t, self.now = self.now, self.now + self.step_s
        return t


class Service:
    def __init__(self) -> None:
        self.released: dict[int, threading.Event] = {}
        self.holding: dict[int, threading.Event] = {}
        self.server: BlockingRpcServer | None = None

    def gate(self, x: int) -> None:
        self.released[x], self.holding[x] = threading.Event(), threading.Event()

    def rpc_echo(self, x: int) -> int:
        return x

    def rpc_last(self, x: int) -> int:
        """The server's last call: a handler sets ``stopping`` (set from outside, the loop may
        read it before it takes the next call in)."""
        assert self.server is not None
        self.server.stopping = True
        return x

    def rpc_held(self, x: int) -> int:
        """Reply only once the test releases ``x`` (see :meth:`gate`)."""
        self.holding[x].set()
        if not self.released[x].wait(HOLD_S):
            raise TimeoutError(f"reply {x} was never released")
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


@pytest.fixture
def stepped_pair(monkeypatch):
    """A connected inproc PAIR (a, b) and the StepClock poll_ready reads instead of perf_counter."""
    clock = StepClock(1e-3)
    monkeypatch.setattr(spin, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://spin-pair")
        b.connect("inproc://spin-pair")
        yield clock, a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("budget_steps", [0, 1, 5])
def test_poll_ready_never_exceeds_its_budget(stepped_pair, budget_steps):
    """Nothing arrives: poll_ready returns [] at the first clock read at or past its
    deadline (one read sets the deadline, then one read per try)."""
    clock, _, b = stepped_pair
    assert poll_ready([(b, zmq.POLLIN)], budget_steps * clock.step_s) == []
    tries = max(budget_steps, 1)
    assert clock.now == pytest.approx((1 + tries) * clock.step_s)


def test_poll_ready_returns_a_waiting_message_before_its_budget(stepped_pair):
    clock, a, b = stepped_pair
    a.send(b"x")
    ready = poll_ready([(b, zmq.POLLIN)], 5.0)  # a message waits: back at once, not at 5 s
    assert [s for s, _ in ready] == [b]
    assert clock.now < 5.0  # returned on the message, not on the budget
    assert b.recv() == b"x"


def _serve(ctx: zmq.Context, service: Service):
    srv = BlockingRpcServer(service, "tcp://127.0.0.1:0", ctx, "spin-test")
    service.server = srv
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


def test_spin_takes_the_reply_or_falls_back_to_the_loop():
    ctx = zmq.Context()
    service = Service()
    srv, thread = _serve(ctx, service)

    async def go() -> None:
        client = RpcClient(srv.address, ctx, timeout=10)
        try:
            assert await client.call("echo", x=0) == 0  # connected
            # A reply within the budget: the spin takes it in and the future is done.
            rid, fut = client.start("echo", RpcClient.encode_args({"x": 1}))
            assert RpcClient.spin([client], fut.done, 5.0)
            assert client.result("echo", fut.result()) == 1
            # A reply after the budget: the spin gives up while the server still holds the
            # reply (so it did not wait for it); the loop delivers it once released.
            service.gate(2)
            rid, fut = client.start("held", RpcClient.encode_args({"x": 2}))
            assert await asyncio.to_thread(service.holding[2].wait, HOLD_S)
            assert not RpcClient.spin([client], fut.done, 1e-3)
            assert not service.released[2].is_set() and not fut.done()
            service.released[2].set()
            assert client.result("held", await asyncio.wait_for(fut, 5)) == 2
            # A call that never gets a reply still times out (the spin does not swallow it).
            service.gate(3)
            rid, fut = client.start("held", RpcClient.encode_args({"x": 3}), 0.1)
            assert not RpcClient.spin([client], fut.done, 1e-3)
            with pytest.raises(RpcTimeout, match="held"):
                await asyncio.wait_for(fut, 5)
            assert not service.released[3].is_set()  # it timed out before any reply existed
            service.released[3].set()  # the held call ends; its late reply is dropped
            assert await client.call("echo", x=4) == 4  # served after the held call: it is over
            assert await client.call("last", x=5) == 5  # the server stops after this reply
        finally:
            await client.close()

    try:
        asyncio.run(go())
        thread.join(5)
        assert not thread.is_alive()
    finally:
        srv.close()
        ctx.destroy(linger=0)
