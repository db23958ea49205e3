"""wait_within (rpc/waits.py), the wait of the in-process endpoints: a result, a timeout that
cancels what it waited for, and a cancellation that is never lost, even in the loop round where
the awaited call finishes (asyncio.wait_for on Python 3.11 drops it there, and the cancelled
task ran on into its next long wait: a run's teardown then hung)."""
from __future__ import annotations

import asyncio

import pytest

from asyncflow.rpc.local_endpoint import LocalEndpoint
from asyncflow.rpc.waits import wait_within


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
