"""An async client calls a TransferQueue service of its own process directly
(``rpc.thread_endpoint``): no socket, but what the caller sees is what it sees over the wire:
nothing stored shares memory with the caller's tensors or objects, the same refusals, the same
error classes and timeouts; a stopped service is reached over the socket again."""
from __future__ import annotations

import pytest
import torch
from _tq_helpers import RPC_TIMEOUT, WAIT_TIMEOUT, run_async

from asyncflow.rpc.async_client import RpcClient
from asyncflow.rpc.codec import CodecError
from asyncflow.rpc.thread_endpoint import ThreadEndpoint, in_process
from asyncflow.transfer_queue import AsyncTransferQueueClient, TransferQueueTimeout, UnknownPartitionError


def _client(tq, direct: bool) -> AsyncTransferQueueClient:
    return AsyncTransferQueueClient(tq.address, timeout=RPC_TIMEOUT, wait_timeout=WAIT_TIMEOUT, direct=direct)


def test_a_service_of_this_process_is_called_directly_unless_the_client_says_not_to(tq):
    async def go():
        direct, wired = _client(tq, True), _client(tq, False)
        try:
            await direct.create_partition("p")
            await direct.put({"x": torch.arange(3)}, "p")  # finds the unit, through the controller
            return (type(direct.controller), {type(e) for e in direct._endpoints.values()},
                    type(wired.controller))
        finally:
            await direct.close()
            await wired.close()

    ctl, units, wired = run_async(go())
    assert ctl is ThreadEndpoint and units == {ThreadEndpoint} and wired is RpcClient


def test_stored_rows_share_nothing_with_the_writer_or_the_readers(tq):
    async def go():
        c = _client(tq, True)
        try:
            await c.create_partition("p")
            x, tags = torch.arange(4), [{"k": [1]} for _ in range(4)]
            await c.put({"x": x, "tag": tags}, "p")
            x.zero_()  # the writer reuses its buffers after the put
            tags[0]["k"].append(2)
            meta, cols = await c.get_batch_columns(["x", "tag"], 4, "a", "p")
            cols["x"].data.fill_(-1)  # a reader writes what it got
            cols["tag"].items[1]["k"].append(3)
            _, again = await c.get_batch_columns(["x", "tag"], 4, "b", "p")
            return again["x"].data.tolist(), again["tag"].items
        finally:
            await c.close()

    x, tags = run_async(go())
    assert x == [0, 1, 2, 3] and tags == [{"k": [1]}] * 4


@pytest.mark.parametrize("async_path", ["socket", "direct"])
def test_refusals_errors_and_timeouts_are_those_of_the_wire(tq, async_path):
    async def go():
        c = _client(tq, async_path == "direct")
        out = {}
        try:
            await c.create_partition("p")
            for name, call in [("codec", c.put({"x": [{1, 2}]}, "p")),
                               ("unknown", c.get_meta(["x"], 1, "t", "nowhere")),
                               ("timeout", c.get_meta(["x"], 1, "t", "p", timeout=0.2))]:
                try:
                    await call
                except Exception as e:  # noqa: BLE001 - what the caller gets is the point
                    out[name] = type(e)
            return out
        finally:
            await c.close()

    got = run_async(go())
    assert got == {"codec": CodecError, "unknown": UnknownPartitionError, "timeout": TransferQueueTimeout}


def test_a_stopped_service_is_withdrawn(tq_factory):
    t = tq_factory()
    address = t.address
    assert in_process(address) is not None
    t.service.stop_in_thread()
    assert in_process(address) is None


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the idle loop's call
def test_a_call_to_a_loop_that_no_longer_runs_ends_at_the_client_s_timeout():
    import asyncio

    class Service:
        async def rpc_echo(self, x):
            return x

    idle = asyncio.new_event_loop()  # never run: as a service's loop after it stopped
    try:
        ep = ThreadEndpoint(Service(), idle, "nowhere", timeout=0.2, timeout_error=TransferQueueTimeout)
        with pytest.raises(TransferQueueTimeout, match="echo on nowhere got no reply within 0.2s"):
            run_async(ep.call("echo", x=1), timeout=10)
    finally:
        idle.close()
