"""wait_within (rpc/waits.py), the wait of the in-process endpoints: a result, a timeout that
cancels what it waited for, and a cancellation that is never lost, even in the loop round where
the awaited call finishes (asyncio.wait_for on Python 3.11 drops it there, and the cancelled
task ran on into its next long wait: a run's teardown then hung)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow.rpc.local_endpoint import LocalEndpoint
from asyncflow.rpc.waits import wait_within
from asyncflow.transfer_queue.columns import column_to_wire, to_column
from asyncflow.transfer_queue.controller import Controller
from asyncflow.transfer_queue.storage import StorageUnit


def test_the_result_or_a_timeout_that_cancels_the_wait():
    async def main():
        assert await wait_within(asyncio.sleep(0, result=7), 1.0) == 7
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(TimeoutError, match="no result within 0.01 s"):
            await wait_within(slow, 0.01)
        await asyncio.sleep(0)
        return slow.cancelled()
    assert asyncio.run(main())


def _cancel_as_it_finishes(wait):
    """Cancel a task waiting on ``wait(inner)`` in the loop round where ``inner`` gets its
    result; what the task did after its wait."""
    async def main():
        inner = asyncio.get_running_loop().create_future()
        after = []

        async def caller():
            await wait(inner)
            after.append("ran on")  # a lost cancellation: the task goes on
            await asyncio.sleep(0.05)

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)  # the task is waiting
        inner.set_result(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return after
    return asyncio.run(main())


def test_a_cancellation_in_the_round_the_wait_ends_is_raised():
    assert _cancel_as_it_finishes(lambda inner: wait_within(inner, 5.0)) == []


def test_a_local_endpoint_call_with_a_timeout_keeps_its_caller_s_cancellation():
    class Service:
        def __init__(self):
            self.inner = None

        async def rpc_get(self):
            return await self.inner

    service = Service()
    ep = LocalEndpoint(service, "svc")

    def wait(inner):
        service.inner = inner
        return ep.call("get", _timeout=5.0)
    assert _cancel_as_it_finishes(wait) == []


WAIT_S = 2.0  # the waits' own timeout below; a lost cancellation shows as their timeout error


def _cancelled_as_woken(start_wait, wake):
    """Start a TransferQueue wait (``start_wait()``: a coroutine that waits for a change),
    then, in one synchronous block, wake it (``wake()``) and cancel it: what awaiting it gives
    ("cancelled", or what it raised or returned instead: its cancellation was lost)."""
    async def main():
        task = asyncio.ensure_future(start_wait())
        for _ in range(3):
            await asyncio.sleep(0)  # the task is now waiting
        assert not task.done()
        wake()
        task.cancel()
        try:
            got = await asyncio.wait_for(task, WAIT_S * 5)
        except asyncio.CancelledError:
            return "cancelled"
        except Exception as e:  # noqa: BLE001 - the test reports which
            return type(e).__name__
        return f"returned {got!r}"
    return asyncio.run(main())


def test_a_controller_get_meta_cancelled_as_its_partition_changes_ends():
    """A cancelled get_meta (its caller gave up) must not wait on, and so cannot consume rows
    for a caller that is gone."""
    ctrl = Controller(default_timeout=5.0)

    async def start():
        await ctrl.rpc_create_partition("p")
        return await ctrl.rpc_get_meta(partition="p", task="t", columns=["x"], batch_size=1, timeout=WAIT_S)

    assert _cancelled_as_woken(start, lambda: ctrl.partitions["p"].wake()) == "cancelled"


def test_a_storage_put_cancelled_as_room_is_freed_ends():
    """A put waiting for room whose caller gave up must not store its rows once room comes."""
    ctrl = Controller(default_timeout=5.0)
    unit = StorageUnit(0, LocalEndpoint(ctrl, "controller"), max_rows=1)

    async def start():
        await ctrl.rpc_create_partition("p")
        await unit.rpc_put("p", {"x": column_to_wire(to_column("x", torch.arange(1)))})
        return await unit.rpc_put("p", {"x": column_to_wire(to_column("x", torch.arange(1)))}, timeout=WAIT_S)

    assert _cancelled_as_woken(start, unit._signal_freed) == "cancelled"
    assert unit.used_rows == 1  # the cancelled put stored nothing
