"""get_meta: event-driven waits, partial batches, end of stream, timeouts that explain
themselves, per-task consumption, replay, and a cost that does not scan the partition."""
from __future__ import annotations

import asyncio
import threading
import time

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import RowsClearedError, TransferQueueTimeout
from asyncflow.transfer_queue.samplers import ReadyRows

# "Promptly" means on the event, not at the waiter's own timeout: a waiter asks with
# WAIT_S and must be back within WAKE_S, far below it, so only a missed wake-up fails (a
# loaded machine delays a woken waiter by far less).
WAIT_S = 60.0
WAKE_S = 20.0


def _keys(n, start=0):
    return {"k": torch.arange(start, start + n)}


async def _blocked(fut, for_s=0.3):
    await asyncio.sleep(for_s)
    assert not fut.done(), "get_meta returned before any row was ready"


def test_blocked_get_meta_wakes_promptly_when_a_producer_puts(tq):
    async def main():
        consumer, producer = tq.async_client(), tq.async_client()
        try:
            await producer.create_partition("p")
            ask = asyncio.ensure_future(consumer.get_meta(["k"], 4, "t", "p", timeout=WAIT_S))
            await _blocked(ask)
            put = await producer.put(_keys(4), "p")
            meta = await asyncio.wait_for(ask, WAKE_S)
            assert meta.rows == put.rows
        finally:
            await consumer.close()
            await producer.close()
    H.run_async(main(), 3 * WAKE_S)


def test_blocked_get_meta_wakes_when_the_last_missing_column_is_added(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            put = await c.put({"a": torch.arange(3)}, "p")
            ask = asyncio.ensure_future(c.get_meta(["a", "b"], 3, "t", "p", timeout=WAIT_S))
            await _blocked(ask)
            await c.put({"b": torch.ones(3)}, "p", put)
            meta = await asyncio.wait_for(ask, WAKE_S)
            assert meta.rows == put.rows and meta.columns == ["a", "b"]
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_blocked_sync_consumer_thread_wakes_when_another_thread_puts(tq):
    c = tq.client
    c.create_partition("p")
    consumer = tq.new_client()
    got = []

    def consume():
        try:
            got.append(consumer.get_meta(["k"], 2, "t", "p", timeout=WAIT_S))
        except Exception as e:  # noqa: BLE001 - reported by the asserts below
            got.append(e)

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    time.sleep(0.3)
    assert not got
    put = c.put(_keys(2), "p")
    th.join(WAKE_S)
    assert not th.is_alive() and got and not isinstance(got[0], Exception), got
    assert got[0].rows == put.rows


def test_allow_partial_returns_what_is_ready_without_waiting(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            put = await c.put(_keys(3), "p")
            # Back long before the WAIT_S the calls allow: neither waits for more rows.
            meta = await asyncio.wait_for(c.get_meta(["k"], 8, "t", "p", allow_partial=True, timeout=WAIT_S),
                                          WAKE_S)
            assert meta.rows == put.rows and not meta.end_of_stream
            empty = await asyncio.wait_for(c.get_meta(["k"], 8, "t", "p", allow_partial=True, timeout=WAIT_S),
                                           WAKE_S)
            assert empty.rows == [] and not empty.end_of_stream
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_min_rows_waits_for_that_many_then_takes_every_ready_row_up_to_the_batch(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            first = await c.put(_keys(2), "p")
            ask = asyncio.ensure_future(c.get_meta(["k"], 16, "t", "p", min_rows=4, timeout=WAIT_S))
            await _blocked(ask)  # 2 ready, 4 wanted at least
            second = await c.put(_keys(8, 2), "p")
            meta = await asyncio.wait_for(ask, WAKE_S)
            assert meta.rows == first.rows + second.rows  # every ready row, not just min_rows
            third = await c.put(_keys(20, 10), "p")
            capped = await c.get_meta(["k"], 16, "t", "p", min_rows=4, timeout=WAIT_S)
            assert capped.rows == third.rows[:16]
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_grouped_min_rows_takes_whole_groups_and_at_least_min_rows(tq):
    async def main():
        c = tq.async_client()
        grouped = {"name": "grpo_group", "group_size": 2}
        try:
            await c.create_partition("p")
            # groups 0 and 1 complete, group 2 half there: 4 rows in whole groups, 5 ready
            put = await c.put(_keys(5), "p", groups=[0, 0, 1, 1, 2])
            ask = asyncio.ensure_future(c.get_meta(["k"], 8, "t", "p", grouped, min_rows=6, timeout=WAIT_S))
            await _blocked(ask)
            more = await c.put(_keys(1, 5), "p", groups=[2])
            meta = await asyncio.wait_for(ask, WAKE_S)
            assert sorted(meta.rows) == sorted(put.rows + more.rows)
            with pytest.raises(Exception, match="min_rows"):
                await c.get_meta(["k"], 4, "t", "p", min_rows=5, timeout=WAIT_S)
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_end_of_stream_drains_the_rest_then_reports_end(tq):
    c = tq.client
    c.create_partition("p")
    put = c.put(_keys(10), "p")
    c.close_partition("p")
    sizes = []
    while True:
        m = c.get_meta(["k"], 4, "t", "p", timeout=2)
        if m.end_of_stream:
            assert m.rows == []
            break
        sizes.append(len(m))
        assert len(sizes) < 10
    assert sizes == [4, 4, 2]
    assert c.get_meta(["k"], 4, "t", "p", timeout=2).end_of_stream  # stays ended
    assert c.get_meta(["k"], 4, "other", "p", timeout=2).rows == put.rows[:4]  # other task: own stream


def test_end_of_stream_waits_for_columns_still_missing_on_existing_rows(tq):
    c = tq.client
    c.create_partition("p")
    put = c.put({"a": torch.arange(4)}, "p")
    c.close_partition("p")
    with pytest.raises(TransferQueueTimeout):  # rows exist that lack "b": the stream has not ended
        c.get_meta(["a", "b"], 8, "t", "p", timeout=0.3)
    c.put({"b": torch.zeros(4)}, "p", put)  # columns may still be added after close
    m = c.get_meta(["a", "b"], 8, "t", "p", timeout=2)
    assert m.rows == put.rows and not m.end_of_stream
    assert c.get_meta(["a", "b"], 8, "t", "p", timeout=2).end_of_stream


def test_waiting_consumer_gets_end_of_stream_promptly_on_close(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            ask = asyncio.ensure_future(c.get_meta(["k"], 4, "t", "p", timeout=WAIT_S))
            await _blocked(ask)
            await c.close_partition("p")
            meta = await asyncio.wait_for(ask, WAKE_S)
            assert meta.end_of_stream and meta.rows == []
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_waiting_consumer_fails_promptly_when_the_partition_is_cleared(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            ask = asyncio.ensure_future(c.get_meta(["k"], 4, "t", "p", timeout=WAIT_S))
            await _blocked(ask)
            await c.clear("p")
            with pytest.raises(RowsClearedError, match="'p' was cleared"):
                await asyncio.wait_for(ask, WAKE_S)
        finally:
            await c.close()
    H.run_async(main(), 3 * WAKE_S)


def test_timeout_message_names_partition_task_missing_columns_and_ready_rows(tq):
    c = tq.client
    c.create_partition("rollout-7")
    m = c.put({"prompts": torch.arange(5)}, "rollout-7")
    c.put({"responses": torch.arange(2)}, "rollout-7", m.select([0, 1]))
    with pytest.raises(TransferQueueTimeout) as e:
        c.get_meta(["prompts", "responses"], 4, "reward-fn", "rollout-7", timeout=0.4)
    msg = str(e.value)
    for part in ("timed out after 0.4s", "'rollout-7'", "'reward-fn'", "4 rows", "2 ready",
                 "responses: 3 rows lack it"):
        assert part in msg, f"{part!r} not in: {msg}"
    assert "prompts:" not in msg  # a column every row has is not reported missing
    assert "close_partition" in msg
    # The timed-out request consumed nothing.
    assert c.get_meta(["prompts", "responses"], 2, "reward-fn", "rollout-7", timeout=1).rows == m.rows[:2]


def test_consumption_is_per_task(tq):
    c = tq.client
    c.create_partition("p")
    put = c.put(_keys(6), "p")
    for task in ("a", "b"):
        got = c.get_meta(["k"], 4, task, "p", timeout=2).rows + c.get_meta(["k"], 2, task, "p", timeout=2).rows
        assert got == put.rows
        assert c.get_meta(["k"], 1, task, "p", allow_partial=True, timeout=1).rows == []
    assert c.status("p")["consumed"] == {"a": 6, "b": 6}


def test_reset_consumption_replays_rows_for_that_task_only(tq):
    c = tq.client
    c.create_partition("p", tasks=["a", "b"])
    put = c.put(_keys(5), "p")
    assert c.get_meta(["k"], 5, "a", "p", timeout=2).rows == put.rows
    assert c.get_meta(["k"], 5, "b", "p", timeout=2).rows == put.rows
    c.reset_consumption("p", "a")
    assert c.get_meta(["k"], 5, "a", "p", timeout=2).rows == put.rows
    assert c.get_meta(["k"], 5, "b", "p", allow_partial=True, timeout=1).rows == []
    assert c.status("p")["consumed"] == {"a": 5, "b": 5}


def test_consumer_waiting_across_reset_consumption_gets_each_row_once(tq):
    """A get_meta that waits through a reset must use the task's state after the reset:
    it neither misses new rows nor hands out a row another consumer took after the reset."""
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p", tasks=["t"])
            first = await c.put(_keys(2), "p")
            waiter = asyncio.ensure_future(c.get_meta(["k"], 3, "t", "p", timeout=5))
            await _blocked(waiter)  # 2 rows ready, it wants 3
            await c.reset_consumption("p", "t")
            other = await c.get_meta(["k"], 1, "t", "p", timeout=2)
            second = await c.put(_keys(1, 2), "p")
            await c.close_partition("p")
            got = (await waiter).rows
            rows = other.rows + got
            assert sorted(rows) == sorted(first.rows + second.rows), (other.rows, got)
        finally:
            await c.close()
    H.run_async(main())


def _counting(base: type) -> type:
    """``base`` (a dict type) counting full walks over it in the class attribute ``scans``."""

    class Counting(base):
        scans = 0

        def __iter__(self):
            type(self).scans += 1
            return super().__iter__()

        def items(self):
            type(self).scans += 1
            return super().items()

        def keys(self):
            type(self).scans += 1
            return super().keys()

        def values(self):
            type(self).scans += 1
            return super().values()

    Counting.__name__ = f"Counting{base.__name__}"
    return Counting


_CountingRows = _counting(dict)  # the controller's row table


def test_get_meta_of_a_few_rows_does_not_scan_a_large_partition(tq):
    c = tq.client
    c.create_partition("p")
    n = 100_000
    c.put({"k": torch.arange(n)}, "p")
    assert c.get_meta(["k"], n, "t", "p", timeout=10).size == n
    part = tq.on_loop(lambda: tq.controller.partitions["p"])

    def instrument():
        part.rows = _CountingRows(part.rows)
    tq.on_loop(instrument)
    _CountingRows.scans = 0
    for i in range(3):
        put = c.put(_keys(8, n + 8 * i), "p")
        sub = tq.on_loop(lambda: part.subs["t"][("k",)])
        assert tq.on_loop(lambda sub=sub: len(sub.ready)) == 8  # only the new rows are pending
        assert c.get_meta(["k"], 8, "t", "p", timeout=2).rows == put.rows
        assert tq.on_loop(lambda sub=sub: len(sub.ready)) == 0
    assert _CountingRows.scans == 0, "a write or get_meta iterated over every row of the partition"
    assert tq.on_loop(lambda: len(part.rows)) == n + 24


_CountingReady = _counting(ReadyRows)  # a subscription's ready rows


def test_grouped_get_meta_does_not_walk_the_ready_rows_of_incomplete_groups(tq):
    """Many ready rows in incomplete groups: a grouped get_meta takes complete groups from
    the subscription's index, at a cost that grows with the batch, not with the ready rows."""
    c = tq.client
    c.create_partition("p")
    n, grpo = 60_000, {"name": "grpo_group", "group_size": 4}
    base = c.put({"k": torch.arange(n)}, "p", groups=[i // 3 for i in range(n)])  # 3 of 4 rows per group
    # The first grouped request indexes the ready rows once; nothing is complete yet.
    assert c.get_meta(["k"], 8, "t", "p", grpo, allow_partial=True, timeout=1).rows == []
    part = tq.on_loop(lambda: tq.controller.partitions["p"])
    sub = tq.on_loop(lambda: part.subs["t"][("k",)])

    def instrument():
        counting = _CountingReady(sub.ready)
        counting.indexes = sub.ready.indexes
        sub.ready = counting
    tq.on_loop(instrument)
    _CountingReady.scans = 0
    first = n // 3
    for i in range(3):
        put = c.put(_keys(8, n + 8 * i), "p", groups=[first + 2 * i] * 4 + [first + 2 * i + 1] * 4)
        assert c.get_meta(["k"], 8, "t", "p", grpo, timeout=2).rows == put.rows
        assert c.get_meta(["k"], 8, "t", "p", grpo, allow_partial=True, timeout=1).rows == []
    # A ready row cleared (group 0 keeps 2), and a row that completes an old group.
    c.clear_rows(base.select([0]))
    late = c.put(_keys(1, 2 * n), "p", groups=[5])
    got = c.get_meta(["k"], 4, "t", "p", grpo, timeout=2)
    assert got.groups == [5] * 4 and got.rows[-1] == late.rows[0]
    assert _CountingReady.scans == 0, "a grouped get_meta walked the ready rows"
    assert tq.on_loop(lambda: len(sub.ready)) == n - 4
