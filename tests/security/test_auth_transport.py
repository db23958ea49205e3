"""Every RPC message is authenticated before it is decoded: forged, tampered, truncated,
untagged and replayed messages are dropped and counted, and the server keeps serving.

Each test talks to a real server over loopback ZMQ with raw sockets, so it controls every
frame on the wire."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
import zmq
import zmq.asyncio

from asyncflow.rpc import auth, codec
from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.async_server import RpcServer
from asyncflow.rpc.blocking_client import BlockingRpcClient
from asyncflow.rpc.blocking_server import BlockingRpcServer
from asyncflow.rpc.errors import RpcTimeout
from asyncflow.rpc.loop_thread import EventLoopThread

WAIT_S = 5.0


class Counter:
    """A service whose only method has a visible side effect."""

    def __init__(self):
        self.calls: list = []

    def _bump(self, n: int = 1, data=None) -> int:
        self.calls.append((n, None if data is None else int(data.sum())))
        return len(self.calls)


class AsyncCounter(Counter):
    async def rpc_bump(self, n: int = 1, data=None) -> int:
        return self._bump(n, data)


class SyncCounter(Counter):
    def rpc_bump(self, n: int = 1, data=None) -> int:
        return self._bump(n, data)


@pytest.fixture(params=["async", "blocking"])
def server(request):
    """A running RpcServer (on an event-loop thread) or BlockingRpcServer (on a thread)."""
    if request.param == "async":
        loop = EventLoopThread("auth-test-server")

        async def start():
            s = RpcServer(AsyncCounter(), "tcp://127.0.0.1:0", zmq.asyncio.Context.instance(), "auth-test")
            s.start()
            return s
        srv = loop.run(start(), timeout=10)
        yield srv
        loop.run(srv.close(), timeout=10)
        loop.stop()
    else:
        ctx = zmq.Context()
        srv = BlockingRpcServer(SyncCounter(), "tcp://127.0.0.1:0", ctx, "auth-test-blocking")
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        yield srv
        # stop through a signed call, then close
        srv.stopping = True
        c = BlockingRpcClient(srv.address, ctx, timeout=2)
        try:
            c.call("bump")
        except RpcTimeout:
            pass
        t.join(5)
        c.close()
        srv.close()
        ctx.destroy(linger=0)


def _request(rid: int, n: int = 1, data=None) -> list:
    args = {"n": n} if data is None else {"n": n, "data": data}
    return codec.encode({"id": rid, "m": "bump", "a": args})


def _signed(frames: list, sender: int = 7, counter: int = 0, key: bytes | None = None) -> list:
    """``[tag + header, *data]`` as bytes, as a client with ``key`` sends it."""
    return [bytes(f) for f in auth.seal(auth.REQUEST, auth.nonce_of(sender, counter), frames, key)]


class Raw:
    """A raw DEALER: sends any frames and reads whatever comes back."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def replies(self, wait_s: float = 0.3) -> list:
        out = []
        while self.sock.poll(int(wait_s * 1000), zmq.POLLIN):
            out.append(self.sock.recv_multipart())
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _still_serves(server) -> None:
    """A legitimate client is answered after the bad messages."""
    before = len(server.service.calls)
    c = BlockingRpcClient(server.address, zmq.Context.instance(), timeout=WAIT_S)
    try:
        assert c.call("bump", n=100) == before + 1
    finally:
        c.close()


def _flip(b: bytes, i: int = -1) -> bytes:
    a = bytearray(b)
    a[i] ^= 0x01
    return bytes(a)


def test_a_signed_message_is_served_and_its_reply_is_signed(server):
    raw = Raw(server.address)
    try:
        raw.send(_signed(_request(0)))
        (reply,) = raw.replies(1.0)
        nonce, body = auth.unseal(auth.REPLY, reply)
        assert nonce == auth.nonce_of(7, 0)  # the reply names the request it answers
        assert codec.decode(body) == {"id": 0, "r": 1}
        assert auth.unseal(auth.REQUEST, reply) is None  # a reply is no request
        assert server.auth_failures == 0
    finally:
        raw.close()


BAD_MESSAGES = {
    "no tag (an old or foreign client)": lambda: [bytes(f) for f in _request(0)],
    "wrong key": lambda: _signed(_request(0), key=auth.generate_key()),
    "tampered header": lambda: (lambda m: [m[0].replace(b'"n":1', b'"n":9'), *m[1:]])(_signed(_request(0))),
    "tampered MAC": lambda: (lambda m: [_flip(m[0], 30), *m[1:]])(_signed(_request(0))),
    "tampered nonce": lambda: (lambda m: [_flip(m[0], 5), *m[1:]])(_signed(_request(0))),
    "tampered small data frame": lambda: (lambda m: [m[0], _flip(m[1], 0)])(
        _signed(_request(0, data=torch.arange(10)))),
    "data frame dropped": lambda: _signed(_request(0, data=torch.arange(10)))[:1],
    "data frame added": lambda: [*_signed(_request(0)), b"extra"],
    "tag only": lambda: [_signed(_request(0))[0][:auth.TAG_BYTES]],
    "empty frame": lambda: [b""],
    "header truncated": lambda: (lambda m: [m[0][:-3], *m[1:]])(_signed(_request(0))),
    "a reply sent as a request": lambda: [bytes(f) for f in auth.seal(auth.REPLY, auth.nonce_of(7, 0), _request(0))],
}


@pytest.mark.parametrize("kind", list(BAD_MESSAGES))
def test_an_unauthentic_message_is_dropped_counted_never_executed(server, kind):
    raw = Raw(server.address)
    try:
        raw.send(BAD_MESSAGES[kind]())
        _wait_for(lambda: server.auth_failures == 1, "the failure to be counted")
        assert raw.replies() == []  # no reply: nothing to learn from
        assert server.service.calls == []  # nothing executed
        assert server.bad_messages == 0  # never reached the decoder
        _still_serves(server)
        assert server.service.calls == [(100, None)]
    finally:
        raw.close()


def test_a_replayed_request_runs_once(server):
    raw = Raw(server.address)
    try:
        msg = _signed(_request(0))
        raw.send(msg)
        raw.send(msg)
        _wait_for(lambda: server.auth_failures == 1, "the replay to be counted")
        assert len(raw.replies()) == 1
        assert server.service.calls == [(1, None)]
        # Out of order within the window is fine; the same counter again is not.
        for c in (5, 3, 4, 3):
            raw.send(_signed(_request(c), counter=c))
        _wait_for(lambda: server.auth_failures == 2, "the second replay")
        assert len(raw.replies()) == 3
        # Another sender may use the same counters.
        raw.send(_signed(_request(0), sender=8))
        assert len(raw.replies(1.0)) == 1
        assert len(server.service.calls) == 5
    finally:
        raw.close()


def test_a_large_data_frame_is_covered_by_length_by_default_and_fully_on_request(server):
    big = torch.arange(auth.SMALL_FRAME, dtype=torch.int32)  # 4x SMALL_FRAME bytes
    raw = Raw(server.address)
    try:
        msg = _signed(_request(0, data=big))
        raw.send([msg[0], msg[1][:-4]])  # a length change is always caught
        _wait_for(lambda: server.auth_failures == 1, "the truncated frame to be refused")
        raw.send([msg[0], _flip(msg[1], 5)])  # same length, other bytes: header-only MAC lets it by
        assert len(raw.replies(1.0)) == 1
        auth.set_cover_all(True)
        try:
            msg = _signed(_request(1, data=big), counter=1)
            raw.send([msg[0], _flip(msg[1], 5)])
            _wait_for(lambda: server.auth_failures == 2, "the tampered frame to be refused")
            raw.send(_signed(_request(2, data=big), counter=2))
            assert len(raw.replies(1.0)) == 1
            # With cover-all on, a receiver refuses a message that covers less.
            auth.set_cover_all(False)
            weaker = _signed(_request(3), counter=3)
            auth.set_cover_all(True)
            raw.send(weaker)
            _wait_for(lambda: server.auth_failures == 3, "the weaker tag to be refused")
        finally:
            auth.set_cover_all(False)
        assert server.bad_messages == 0
    finally:
        raw.close()


def test_a_flood_of_forged_messages_does_not_stop_the_server(server):
    raw = Raw(server.address)
    try:
        key = auth.generate_key()
        for i in range(300):
            raw.send(_signed(_request(i), counter=i, key=key))
        _wait_for(lambda: server.auth_failures == 300, "every forged message to be counted")
        assert server.service.calls == []
        _still_serves(server)
    finally:
        raw.close()


# ---- the client side ----------------------------------------------------------------------

class FakeServer:
    """A ROUTER that answers each request with whatever ``make_replies(ident, frames)`` says."""

    def __init__(self, make_replies):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.make_replies = make_replies
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            if self.sock.poll(50, zmq.POLLIN):
                ident, *frames = self.sock.recv_multipart()
                for r in self.make_replies(frames):
                    self.sock.send_multipart([ident, *r])

    def close(self):
        self._stop = True
        self.t.join(5)
        self.ctx.destroy(linger=0)


def _answer(frames, key=None, result=1, nonce=None, rid=None):
    got, request = auth.unseal(auth.REQUEST, frames)
    msg = codec.decode(request)
    body = codec.encode({"id": msg["id"] if rid is None else rid, "r": result})
    return auth.seal(auth.REPLY, nonce if nonce is not None else got, body, key)


def _untagged_answer(frames):
    return codec.encode({"id": codec.decode(auth.unseal(auth.REQUEST, frames)[1])["id"], "r": 1})


CLIENT_CASES = {
    "reply under another key": lambda f: [_answer(f, key=auth.generate_key())],
    "reply without a tag": lambda f: [_untagged_answer(f)],
    "reply to another sender's request": lambda f: [_answer(f, nonce=auth.nonce_of(12345, 0))],
}


@pytest.mark.parametrize("kind", list(CLIENT_CASES))
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_client_drops_an_unauthentic_reply(kind, blocking):
    fake = FakeServer(CLIENT_CASES[kind])
    try:
        if blocking:
            c = BlockingRpcClient(fake.address, zmq.Context.instance(), timeout=0.5)
            with pytest.raises(RpcTimeout, match="run's key"):
                c.call("bump")
            assert c.auth_failures == 1
            c.close()
        else:
            async def go():
                c = RpcClient(fake.address, zmq.asyncio.Context.instance(), timeout=0.5)
                try:
                    with pytest.raises(RpcTimeout, match="run's key"):
                        await c.call("bump")
                    return c.auth_failures
                finally:
                    await c.close()
            assert asyncio.run(go()) == 1
    finally:
        fake.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_replayed_or_mislabelled_reply_is_not_taken(blocking):
    """A reply played twice answers one call only; a reply whose header names another call
    than its tag is dropped."""
    state = {"n": 0, "last": None}

    def replies(frames):
        state["n"] += 1
        if state["n"] == 1:
            state["last"] = _answer(frames, result="first")
            return [state["last"]]
        if state["n"] == 2:  # the first reply again, then nothing: the second call must time out
            return [state["last"]]
        return [_answer(frames, rid=999)]  # the tag's nonce and the header's id disagree

    fake = FakeServer(replies)
    try:
        if blocking:
            c = BlockingRpcClient(fake.address, zmq.Context.instance(), timeout=0.5)
            assert c.call("bump") == "first"
            with pytest.raises(RpcTimeout):
                c.call("bump")
            with pytest.raises(RpcTimeout):
                c.call("bump")
            c.close()
        else:
            async def go():
                c = RpcClient(fake.address, zmq.asyncio.Context.instance(), timeout=0.5)
                try:
                    assert await c.call("bump") == "first"
                    for _ in range(2):
                        with pytest.raises(RpcTimeout):
                            await c.call("bump")
                finally:
                    await c.close()
            asyncio.run(go())
    finally:
        fake.close()
