"""Bounded storage units: puts over capacity wait for clears (backpressure), puts that
can never fit or wait too long fail with CapacityError, and clears return the room.

Waiting is observed as an event (a put found no room and began to wait), never as elapsed
wall-clock time."""
from __future__ import annotations

import asyncio
import threading

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import CapacityError
from asyncflow.transfer_queue.storage import StorageUnit

PUT_WAIT_S = 20  # a put woken by a clear never gets near this; reaching it fails the test


def _rows(n, start=0):
    return {"k": torch.arange(start, start + n), "ids": [torch.arange(1 + i % 5) for i in range(n)]}


def _used(tq):
    (s,) = tq.client.unit_stats()
    return s["rows"], s["bytes"]


@pytest.fixture
def put_blocked(monkeypatch) -> threading.Event:
    """Set when a put that fits the capacity finds no room and starts waiting for some."""
    blocked = threading.Event()
    wait_for_room = StorageUnit._wait_for_room

    async def watched(self, partition, rows, nbytes, timeout):
        fits_ever = ((self.max_rows is None or rows <= self.max_rows)
                     and (self.max_bytes is None or nbytes <= self.max_bytes))
        if fits_ever and not self._fits(rows, nbytes):
            blocked.set()
        return await wait_for_room(self, partition, rows, nbytes, timeout)

    monkeypatch.setattr(StorageUnit, "_wait_for_room", watched)
    return blocked


@pytest.mark.parametrize("free_with", ["clear_rows", "clear"])
def test_put_over_capacity_blocks_until_a_clear_makes_room(tq_factory, put_blocked, free_with):
    tq = tq_factory(max_rows_per_unit=8)

    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("old")
            await c.create_partition("new")
            old = await c.put(_rows(6), "old")
            put = asyncio.ensure_future(c.put(_rows(4, 100), "new", timeout=PUT_WAIT_S))
            assert await asyncio.to_thread(put_blocked.wait, PUT_WAIT_S), "the put never waited for room"
            assert not put.done(), "a put over capacity did not wait for room"
            assert _used(tq)[0] == 6  # nothing of the waiting put is stored yet
            if free_with == "clear_rows":
                assert await c.clear_rows(old.select([0, 1])) == 2
            else:
                assert await c.clear("old") == 6
            meta = await put  # woken by the clear: a put left waiting fails at PUT_WAIT_S
            got = await c.get_columns(meta)
            assert got["k"].data.tolist() == [100, 101, 102, 103]
        finally:
            await c.close()
    H.run_async(main(), timeout=3 * PUT_WAIT_S)
    assert _used(tq)[0] == (8 if free_with == "clear_rows" else 4)


def test_put_that_can_never_fit_fails_at_once(tq_factory, put_blocked):
    tq = tq_factory(max_rows_per_unit=8)
    c = tq.client
    c.create_partition("p")
    c.put(_rows(3), "p")
    before = _used(tq)
    # "can never fit" is the check made before any wait (a put that waited says "stayed full").
    with pytest.raises(CapacityError, match=r"storage unit 0: a put of 9 rows .* can never fit"):
        c.put(_rows(9), "p", timeout=PUT_WAIT_S)
    assert not put_blocked.is_set()
    assert _used(tq) == before
    assert c.status("p")["rows"] == 3


def test_put_that_can_never_fit_in_bytes_fails_at_once(tq_factory):
    tq = tq_factory(max_bytes_per_unit=1000)
    tq.client.create_partition("p")
    with pytest.raises(CapacityError, match="can never fit"):
        tq.client.put({"x": torch.zeros(200, dtype=torch.float64)}, "p", timeout=5)
    assert _used(tq) == (0, 0)


def test_put_that_waits_too_long_fails_naming_the_unit(tq_factory, put_blocked):
    tq = tq_factory(max_rows_per_unit=8)
    c = tq.client
    c.create_partition("p")
    first = c.put(_rows(8), "p")
    before = _used(tq)
    with pytest.raises(CapacityError) as e:
        c.put(_rows(1, 50), "p", timeout=0.3)
    assert put_blocked.is_set()  # it failed after waiting for room, not before
    msg = str(e.value)
    assert "storage unit 0 stayed full for 0.3s" in msg and "rows 8/8" in msg and "'p'" in msg
    assert _used(tq) == before
    assert c.status("p")["rows"] == 8
    assert c.get_columns(first)["k"].data.tolist() == list(range(8))


def test_used_rows_and_bytes_return_to_zero_after_clears(tq_factory):
    tq = tq_factory(max_rows_per_unit=100)
    c = tq.client
    c.create_partition("a")
    c.create_partition("b")
    ma = c.put(_rows(10), "a")
    c.put({"extra": torch.ones(10, 3)}, "a", ma)  # a second batch holding a column of the same rows
    mb = c.put(_rows(7), "b")
    rows, nbytes = _used(tq)
    assert rows == 17 and nbytes > 0
    assert c.clear_rows(ma.select(range(4))) == 4  # partly cleared batches stay until their last row goes
    assert _used(tq)[0] == 13
    assert c.clear_rows(ma.select(range(4, 10))) == 6
    assert c.clear("b") == 7
    assert _used(tq) == (0, 0)
    st = tq.client.unit_stats()[0]
    assert st["batches"] == 0
    # The freed room is usable again, up to the limit.
    c.create_partition("c")
    c.put(_rows(100), "c", timeout=1)
    assert _used(tq)[0] == 100
    assert len(mb) == 7
