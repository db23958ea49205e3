"""Every bad request gets a clear error, and nothing already stored changes: after each
error the partition's status, the units' accounting, and the stored bytes are as before."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch
from _tq_helpers import plain_column

from asyncflow.transfer_queue import (
    BadPutError,
    RowsClearedError,
    SchemaMismatchError,
    UnknownPartitionError,
    UnknownTaskError,
)
from asyncflow.transfer_queue.columns import FixedColumn, JaggedColumn, ObjectColumn, column_to_wire


def _data(n, start=0):
    return {
        "k": torch.arange(start, start + n),
        "ids": [torch.arange(1 + i % 4, dtype=torch.int64) + 10 * i for i in range(start, start + n)],
        "text": [f"t{i}" for i in range(start, start + n)],
    }


@pytest.fixture
def filled(tq):
    """Partition 'p' with 6 rows (k, ids, text) and a 'score' column on rows 0..2."""
    c = tq.client
    c.create_partition("p", tasks=["t"])
    meta = c.put(_data(6), "p")
    c.put({"score": torch.tensor([0.5, 1.5, 2.5])}, "p", meta.select([0, 1, 2]))

    def state():
        cols = c.get_columns(meta.with_columns(["k", "ids", "text"]))
        scores = c.get_columns(meta.select([0, 1, 2], ["score"]))
        return (c.status("p"), c.unit_stats(), c.status()["partitions"],
                {k: plain_column(v) for k, v in {**cols, **scores}.items()})

    before = state()
    return tq, meta, state, before


def test_put_with_columns_of_different_row_counts_is_refused(filled):
    tq, meta, state, before = filled
    with pytest.raises(ValueError, match=r"different row counts.*'k': 3.*'ids': 2"):
        tq.client.put({"k": torch.arange(3), "ids": [torch.arange(2)] * 2}, "p")
    with pytest.raises(BadPutError, match="data has 2 rows, meta names 3"):
        tq.client.put({"extra": torch.zeros(2)}, "p", meta.select([3, 4, 5]))
    with pytest.raises(BadPutError, match="3 group ids for 2 rows"):
        tq.client.put({"k": torch.arange(2)}, "p", groups=[0, 0, 1])
    assert state() == before


def test_storage_unit_itself_refuses_columns_of_different_row_counts(filled):
    """The unit checks again what a client (of any version) sends it."""
    tq, meta, state, before = filled

    async def raw_put():
        c = tq.async_client()
        try:
            unit = await c._unit(0)
            wire = {"k": column_to_wire(FixedColumn(torch.arange(3))),
                    "x": column_to_wire(FixedColumn(torch.arange(2)))}
            await unit.call("put", partition="p", columns=wire)
        finally:
            await c.close()

    with pytest.raises(BadPutError, match="different row counts"):
        asyncio.run(asyncio.wait_for(raw_put(), 20))
    assert state() == before


def test_unknown_partition_is_refused_by_put_and_get_meta(filled):
    tq, meta, state, before = filled
    with pytest.raises(UnknownPartitionError, match=r"unknown partition 'nope'.*create_partition.*'p'"):
        tq.client.put(_data(2), "nope")
    with pytest.raises(UnknownPartitionError, match="unknown partition 'nope'"):
        tq.client.get_meta(["k"], 1, "t", "nope", timeout=1)
    assert state() == before


def test_unknown_task_in_reset_consumption_is_refused(filled):
    tq, meta, state, before = filled
    tq.client.get_meta(["k"], 2, "t", "p", timeout=1)
    before = state()
    with pytest.raises(UnknownTaskError, match=r"unknown task 'nobody'.*'t'"):
        tq.client.reset_consumption("p", "nobody")
    assert state() == before
    assert tq.client.get_meta(["k"], 4, "t", "p", timeout=1).rows == meta.rows[2:]


@pytest.mark.parametrize("bad,holds,sends", [
    ({"k": torch.arange(2, dtype=torch.int32)}, "fixed int64[]", "fixed int32[]"),
    ({"k": torch.zeros(2, 3, dtype=torch.int64)}, "fixed int64[]", "fixed int64[3]"),
    ({"ids": [torch.zeros(2)] * 2}, "jagged int64[]", "jagged float32[]"),
    ({"ids": torch.zeros(2, 5, dtype=torch.int64)}, "jagged int64[]", "fixed int64[5]"),  # kind
    ({"k": [torch.arange(3)] * 2}, "fixed int64[]", "jagged int64[]"),  # kind
    ({"text": torch.zeros(2)}, "object", "fixed float32[]"),
], ids=["dtype", "row-shape", "jagged-dtype", "jagged-to-fixed", "fixed-to-jagged", "object-to-tensor"])
def test_new_rows_with_a_different_column_schema_are_refused(filled, bad, holds, sends):
    tq, meta, state, before = filled
    col = next(iter(bad))
    with pytest.raises(SchemaMismatchError,
                       match=re.escape(f"column '{col}': holds {holds} but this put sends {sends}")):
        tq.client.put(bad, "p")
    assert state() == before


def test_added_column_with_a_different_schema_is_refused(filled):
    tq, meta, state, before = filled
    with pytest.raises(SchemaMismatchError,
                       match=r"'score': holds fixed float32\[\] but this put sends fixed int64\[\]"):
        tq.client.put({"score": torch.tensor([1, 2, 3])}, "p", meta.select([3, 4, 5]))
    assert state() == before


def test_schema_is_fixed_by_the_first_write_even_when_a_reader_asked_first(tq):
    c = tq.client
    c.create_partition("q")
    assert c.get_meta(["x"], 1, "t", "q", allow_partial=True, timeout=1).rows == []  # a waiting reader
    c.put({"x": torch.arange(3)}, "q")
    assert c.status("q")["columns"]["x"] == ["fixed", "int64", []]
    with pytest.raises(SchemaMismatchError, match="'x': holds fixed int64"):
        c.put({"x": torch.ones(3)}, "q")
    assert c.status("q")["rows"] == 3


def test_writing_a_column_twice_to_the_same_rows_is_refused(filled):
    tq, meta, state, before = filled
    with pytest.raises(BadPutError, match="already have column 'score'; columns are written once per row"):
        tq.client.put({"score": torch.tensor([9.0, 9.0])}, "p", meta.select([2, 3]))
    with pytest.raises(BadPutError, match="already have column 'ids'"):
        tq.client.put({"ids": [torch.arange(1)] * 6}, "p", meta)
    assert state() == before
    # The rows that lacked the column can still get it.
    tq.client.put({"score": torch.tensor([3.5, 4.5, 5.5])}, "p", meta.select([3, 4, 5]))
    assert tq.client.get_columns(meta.with_columns(["score"]))["score"].data.tolist() == [
        0.5, 1.5, 2.5, 3.5, 4.5, 5.5]


def test_new_rows_into_a_closed_partition_are_refused(filled):
    tq, meta, state, before = filled
    tq.client.close_partition("p")
    before = state()
    with pytest.raises(BadPutError, match="'p' is closed"):
        tq.client.put(_data(2), "p")
    assert state() == before


def test_get_data_of_cleared_rows_is_refused_and_other_rows_stay_readable(filled):
    tq, meta, state, before = filled
    c = tq.client
    assert c.clear_rows(meta.select([1, 4])) == 2
    with pytest.raises(RowsClearedError, match=rf"rows \[{meta.rows[1]}, {meta.rows[4]}\] were cleared"):
        c.get_data(meta.with_columns(["k"]))
    with pytest.raises(RowsClearedError, match=rf"rows \[{meta.rows[4]}\] were cleared"):
        c.put({"score": torch.tensor([1.0])}, "p", meta.select([4]))
    left = meta.select([0, 2, 3, 5], ["k", "ids", "text"])
    got = c.get_columns(left)
    assert got["k"].data.tolist() == [0, 2, 3, 5]
    assert plain_column(got["ids"]) == plain_column(JaggedColumn(*_ids_of([0, 2, 3, 5])))
    assert got["text"].items == ["t0", "t2", "t3", "t5"]
    assert c.status("p")["rows"] == 4


def _ids_of(keys):
    rows = [torch.arange(1 + k % 4, dtype=torch.int64) + 10 * k for k in keys]
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    return torch.cat(rows), offsets


def test_cleared_partition_is_refused_by_get_data_get_meta_and_put(filled):
    tq, meta, state, before = filled
    c = tq.client
    assert c.clear("p") == 6
    with pytest.raises(RowsClearedError, match="'p' was cleared"):
        c.get_data(meta.with_columns(["k"]))
    with pytest.raises(RowsClearedError, match="'p' was cleared"):
        c.get_meta(["k"], 1, "t", "p", timeout=1)
    with pytest.raises(RowsClearedError, match="'p' was cleared"):
        c.put(_data(1), "p")
    # A refused put leaves no trace in the unit: reads still say the partition was cleared.
    with pytest.raises(RowsClearedError, match="'p' was cleared"):
        c.get_data(meta.with_columns(["k"]))
    st = c.unit_stats()[0]
    assert {k: st[k] for k in ("unit", "rows", "bytes", "batches", "partitions", "foreign_rows")} == {
        "unit": 0, "rows": 0, "bytes": 0, "batches": 0, "partitions": 0, "foreign_rows": 0}
    # The name can be created again, empty.
    c.create_partition("p")
    assert c.status("p")["rows"] == 0


def test_refused_put_into_an_unknown_partition_leaves_the_unit_unchanged(tq):
    c = tq.client
    before = c.unit_stats()
    with pytest.raises(UnknownPartitionError):
        c.put(_data(3), "ghost")
    assert c.unit_stats() == before


@pytest.mark.parametrize("kw,err", [
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"columns": []}, "non-empty list of column names"),
    ({"task": ""}, "task must be a non-empty string"),
    ({"sampler": "nope"}, "unknown sampler 'nope'"),
    ({"sampler": {"name": "grpo_group", "size": 4}}, "bad options"),
])
def test_bad_get_meta_arguments_are_refused_and_consume_nothing(filled, kw, err):
    tq, meta, state, before = filled
    args = {"columns": ["k"], "batch_size": 2, "task": "t", "partition": "p", **kw}
    with pytest.raises(ValueError, match=err):
        tq.client.get_meta(timeout=1, **args)
    assert tq.client.get_meta(["k"], 6, "t", "p", timeout=1).rows == meta.rows



def test_object_column_using_the_codec_reserved_key_is_refused_at_once(filled):
    """Dicts in an object column that contain the wire codec's tensor key cannot travel: the
    sender must refuse them with an error, not send a message the unit drops as malformed
    (which the caller would only see as a reply timeout)."""
    tq, meta, state, before = filled

    async def raw_put():
        c = tq.async_client()
        try:
            unit = await c._unit(0)
            wire = {"info": column_to_wire(ObjectColumn([{"__t": 0, "d": "int8", "s": [1]}]))}
            await unit.call("put", _timeout=2.0, partition="p", columns=wire)
        finally:
            await c.close()

    with pytest.raises(ValueError, match="reserved"):
        asyncio.run(asyncio.wait_for(raw_put(), 20))
    assert state() == before
