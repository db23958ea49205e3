"""Two requests a step folded into others: a partition created with ``close_at=n`` closes itself
once it holds n rows (no close_partition), and ``clear_then_stats`` frees a partition and
returns every unit's stats in one reply (no unit_stats). Wrong counts are refused with the
partition's rows untouched."""
from __future__ import annotations

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import BadPutError, NewPartition, UnknownPartitionError


def _drain(c, task: str) -> tuple[list[int], bool]:
    """Every row ``task`` gets from 'p', and whether the stream then ended."""
    rows: list[int] = []
    for _ in range(10):
        m = c.get_meta(["k"], 4, task, "p", timeout=2)
        if m.end_of_stream:
            return rows, True
        rows += m.rows
    return rows, False


def test_a_partition_created_with_close_at_ends_its_stream_at_that_row_count(tq):
    c = tq.client
    c.create_partition("p", close_at=6)
    first = c.put({"k": torch.arange(4)}, "p")
    assert not c.status("p")["closed"]  # 4 of 6: more may come
    rest = c.put({"k": torch.arange(4, 6)}, "p")
    assert c.status("p")["closed"]
    assert _drain(c, "t") == (first.rows + rest.rows, True)


def test_rows_beyond_close_at_are_refused_and_the_stored_ones_stay(tq):
    c = tq.client
    c.create_partition("p", close_at=4)
    put = c.put({"k": torch.arange(3)}, "p")
    with pytest.raises(BadPutError, match=r"partition 'p' was created for 4 rows \(close_at\) and holds 3: "
                                          r"2 new rows would exceed it"):
        c.put({"k": torch.arange(2)}, "p")
    status = c.status("p")
    assert status["rows"] == 3 and not status["closed"]
    assert c.get_columns(put, ["k"])["k"].data.tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "4"])
def test_a_close_at_that_is_no_row_count_is_refused(tq, bad):
    with pytest.raises(ValueError, match="close_at must be a row count >= 1"):
        tq.client.create_partition("p", close_at=bad)
    assert "p" not in tq.client.status()["partitions"]


def test_close_at_below_the_rows_held_is_refused(tq):
    c = tq.client
    c.create_partition("p")
    c.put({"k": torch.arange(3)}, "p")
    with pytest.raises(ValueError, match=r"close_at=2, but it already holds 3 rows"):
        c.create_partition("p", close_at=2)
    assert not c.status("p")["closed"]


def test_clear_then_stats_frees_the_partition_and_reports_the_units_after(tq):
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p")
            await c.put({"k": torch.arange(5)}, "p")
            held = await c.unit_stats()
            freed, after = await c.clear_then_stats("p")
            return held, freed, after, await c.unit_stats()
        finally:
            await c.close()
    held, freed, after, asked = H.run_async(main())
    assert freed == 5
    assert sum(u["rows"] for u in held) == 5
    assert sum(u["rows"] for u in after) == 0 and sum(u["bytes"] for u in after) == 0
    assert after == asked  # the same stats unit_stats gives


def test_a_put_of_new_rows_creates_its_partition_in_the_same_request(tq):
    c = tq.client
    before = c.status()["partitions"]
    first = c.put({"k": torch.arange(4)}, "p", create=NewPartition(close_at=6))
    assert "p" in c.status()["partitions"] and "p" not in before
    assert not c.status("p")["closed"]  # 4 of 6: more may come, with plain puts
    rest = c.put({"k": torch.arange(4, 6)}, "p")
    assert c.status("p")["closed"]
    assert _drain(c, "t") == (first.rows + rest.rows, True)


def test_a_put_that_creates_a_partition_existing_already_only_adds_its_tasks(tq):
    c = tq.client
    c.create_partition("p", tasks=["a"])
    put = c.put({"k": torch.arange(2)}, "p", create=NewPartition(tasks=["b"]))
    assert c.get_columns(put, ["k"])["k"].data.tolist() == [0, 1]
    assert {"a", "b"} <= set(c.status("p")["tasks"])


def test_a_refused_put_that_would_create_its_partition_leaves_neither_rows_nor_partition(tq):
    c = tq.client
    with pytest.raises(BadPutError, match=r"partition 'p' was created for 2 rows \(close_at\) and holds 0: "
                                          r"3 new rows would exceed it"):
        c.put({"k": torch.arange(3)}, "p", create=NewPartition(close_at=2))
    with pytest.raises(ValueError, match="close_at must be a row count >= 1"):
        c.put({"k": torch.arange(3)}, "p", create=NewPartition(close_at=0))
    assert "p" not in c.status()["partitions"]
    assert sum(u["rows"] for u in c.unit_stats()) == 0
    with pytest.raises(UnknownPartitionError, match="create it first"):
        c.put({"k": torch.arange(3)}, "p")  # a plain put still needs the partition


def test_only_a_put_of_new_rows_may_create_a_partition(tq):
    c = tq.client
    c.create_partition("p")
    put = c.put({"k": torch.arange(3)}, "p")
    with pytest.raises(BadPutError, match="create= is for a put of new rows"):
        c.put({"v": torch.ones(3)}, "p", put, create=NewPartition())
    with pytest.raises(ValueError, match=r"tasks must be a list of names, got the string 'train'"):
        c.put({"k": torch.arange(3)}, "q", create=NewPartition(tasks="train"))
    assert c.get_columns(put, ["k"])["k"].data.tolist() == [0, 1, 2]
    assert "v" not in c.status("p")["columns"] and "q" not in c.status()["partitions"]


def test_the_async_client_creates_the_partition_with_its_put(tq):
    async def main():
        c = tq.async_client()
        try:
            put = await c.put({"k": torch.arange(5)}, "p", groups=[0, 0, 1, 1, 2], create=NewPartition(close_at=5))
            meta = await c.get_meta(["k"], 5, "t", "p", timeout=2)
            return put, meta, await c.status("p")
        finally:
            await c.close()
    put, meta, status = H.run_async(main())
    assert meta.rows == put.rows and list(meta.groups) == [0, 0, 1, 1, 2]
    assert status["closed"] and status["rows"] == 5
