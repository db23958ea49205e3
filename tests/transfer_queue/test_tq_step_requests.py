"""Two requests a step folded into others: a partition created with ``close_at=n`` closes itself
once it holds n rows (no close_partition), and ``clear_then_stats`` frees a partition and
returns every unit's stats in one reply (no unit_stats). Wrong counts are refused with the
partition's rows untouched."""
from __future__ import annotations

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import BadPutError


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
