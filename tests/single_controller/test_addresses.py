"""Worker addresses in the rendezvous store: TCP for every node, plus an ipc:// socket that
a driver sharing the worker's kernel and network namespace uses instead (calls_address)."""
from __future__ import annotations

import pytest
import zmq

from asyncflow.single_controller.runtime import calls_address, host_key, ipc_address, join_address, split_address

TCP, CONTROL = "tcp://10.1.2.3:4000", "tcp://10.1.2.3:4001"


def test_two_field_address_is_unchanged():
    a = join_address(TCP, CONTROL)
    assert a == f"{TCP}|{CONTROL}"
    assert split_address(a) == (TCP, CONTROL)
    assert calls_address(a) == TCP


@pytest.mark.parametrize("bad", ["tcp://x:1", "a|b|c|d", "|b", "a||c"])
def test_malformed_addresses_are_refused(bad):
    with pytest.raises(ValueError):
        split_address(bad)


@pytest.mark.skipif(ipc_address() is None, reason="no abstract Unix sockets here (not Linux, or no ipc in libzmq)")
def test_ipc_only_on_the_same_host_and_namespace():
    local = ipc_address()
    assert local.startswith("ipc://@") and local != ipc_address()  # fresh each time
    a = join_address(TCP, CONTROL, local)
    assert split_address(a) == (TCP, CONTROL)
    assert calls_address(a) == local
    boot, _, netns = host_key().partition(":")
    for other in (f"another-boot:{netns}", f"{boot}:1"):  # another node; another network namespace
        assert calls_address(f"{TCP}|{CONTROL}|{other} {local}") == TCP
    assert calls_address(f"{TCP}|{CONTROL}|{host_key()} tcp://127.0.0.1:1") == TCP  # only ipc:// is taken
    # And the address works: a ROUTER bound there answers a DEALER connected to it.
    ctx = zmq.Context()
    r, d = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        r.bind(local)
        d.connect(calls_address(a))
        d.send(b"hi")
        assert r.poll(5000) and r.recv_multipart()[1] == b"hi"
    finally:
        r.close(linger=0)
        d.close(linger=0)
        ctx.term()
