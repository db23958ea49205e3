"""Through a running service: malformed columns are refused where they enter (the client's
to_column, the storage unit's put) naming the column and the cause, with nothing stored
changed; object columns are counted by their real size against a unit's byte capacity; a
read of a column that is missing or not yet written raises MissingColumnError."""
from __future__ import annotations

import asyncio

import pytest
import torch
from _tq_helpers import plain_column

from asyncflow.transfer_queue import BadPutError, CapacityError
from asyncflow.transfer_queue.columns import FixedColumn, JaggedColumn, ObjectColumn, column_to_wire
from asyncflow.transfer_queue.errors import MissingColumnError


def _data(n: int) -> dict:
    return {"k": torch.arange(n), "ids": [torch.arange(1 + i % 3) + 10 * i for i in range(n)]}


@pytest.fixture
def filled(tq):
    """Partition 'p' with 4 rows (k, ids); ``state()`` is everything a bad request must leave as is."""
    c = tq.client
    c.create_partition("p", tasks=["t"])
    meta = c.put(_data(4), "p")

    def state():
        cols = c.get_columns(meta.with_columns(["k", "ids"]))
        return c.status("p"), c.unit_stats(), {k: plain_column(v) for k, v in cols.items()}

    return tq, meta, state, state()


BAD_JAGGED = [
    (JaggedColumn(torch.arange(3), torch.tensor([0, 2, 10])), "offsets end at 10 but values has 3 rows"),
    (JaggedColumn(torch.arange(3), torch.tensor([0, 3, 1, 3])), r"offsets decrease at row 1 \(3 -> 1\)"),
    (JaggedColumn(torch.arange(3), torch.tensor([1, 3])), r"offsets\[0\] is 1, must be 0"),
]


@pytest.mark.parametrize("col,err", BAD_JAGGED)
def test_client_put_of_a_malformed_jagged_column_is_refused(filled, col, err):
    tq, meta, state, before = filled
    with pytest.raises(ValueError, match=rf"column 'resp': jagged column {err}"):
        tq.client.put({"resp": col}, "p", meta.select(range(len(col))))
    with pytest.raises(ValueError, match=rf"column 'resp': jagged column {err}"):
        tq.client.put({"k": torch.arange(len(col)), "resp": col}, "p")
    assert state() == before


def _raw_put(tq, columns: dict, **args) -> None:
    """A put straight to the unit, as a client of any version (or a bad actor) may send it."""
    async def main():
        c = tq.async_client()
        try:
            unit = await c._unit(0)
            await unit.call("put", partition="p", columns=columns, **args)
        finally:
            await c.close()
    asyncio.run(asyncio.wait_for(main(), 20))


@pytest.mark.parametrize("col,err", BAD_JAGGED + [
    (FixedColumn(torch.tensor(3)), "fixed column data is a 0-d tensor"),
    (JaggedColumn(torch.tensor(3), torch.tensor([0])), "jagged column values is a 0-d tensor"),
])
def test_storage_unit_refuses_a_malformed_column_and_changes_nothing(filled, col, err):
    tq, meta, state, before = filled
    # (the columns are checked before their row counts are compared: the count of "k" is moot)
    wire = {"k": column_to_wire(FixedColumn(torch.arange(2))), "resp": column_to_wire(col)}
    with pytest.raises(BadPutError, match=rf"put into 'p': column 'resp': [a-z ]*{err}.*nothing was stored"):
        _raw_put(tq, wire)
    assert state() == before


def test_storage_unit_refuses_a_malformed_column_added_to_existing_rows(filled):
    tq, meta, state, before = filled
    wire = {"resp": column_to_wire(JaggedColumn(torch.arange(3), torch.tensor([0, 2, 10])))}
    with pytest.raises(BadPutError, match="column 'resp': jagged column offsets end at 10"):
        _raw_put(tq, wire, rows=meta.select([0, 1]).rows)
    assert state() == before
    meta2 = tq.client.put({"resp": [torch.arange(2), torch.arange(1)]}, "p", meta.select([0, 1]))  # still writable
    assert tq.client.get_columns(meta2, ["resp"])["resp"].lengths().tolist() == [2, 1]


# ---- reads of columns that are missing -----------------------------------------------------

def test_reading_a_missing_or_unwritten_column_raises_missing_column_error(filled):
    tq, meta, state, before = filled
    c = tq.client
    with pytest.raises(MissingColumnError, match="'p' has no column 'nope' in unit 0.*check the name"):
        c.get_data(meta, ["k", "nope"])
    c.put({"j": torch.ones(2)}, "p", meta.select([0, 1]))
    with pytest.raises(MissingColumnError, match=rf"rows \[{meta.rows[2]}, {meta.rows[3]}\] have no column 'j' yet"):
        c.get_columns(meta, ["j"])
    with pytest.raises(KeyError):  # a LookupError, as the class it replaces for unwritten columns
        c.get_columns(meta, ["j"])
    assert c.get_columns(meta.select([0, 1]), ["j"])["j"].data.tolist() == [1.0, 1.0]


# ---- object columns count their real size ---------------------------------------------------

OVERHEAD = 56  # per object item (see columns._OBJECT_ITEM_OVERHEAD)


def _used(tq) -> tuple[int, int]:
    (s,) = tq.client.unit_stats()
    return s["rows"], s["bytes"]


def test_strings_are_counted_by_their_size(tq_factory):
    tq = tq_factory()
    tq.client.create_partition("p")
    tq.client.put({"s": ["a" * 1000, "é" * 10, ""]}, "p")
    assert _used(tq) == (3, 1000 + 20 + 0 + 3 * OVERHEAD)


def test_a_put_of_strings_larger_than_the_unit_can_never_fit(tq_factory):
    tq = tq_factory(max_bytes_per_unit=1000)
    c = tq.client
    c.create_partition("p")
    c.put({"s": ["small"]}, "p")
    before = _used(tq)
    # "can never fit" is the check made before any wait (a put that waited says "stayed full").
    with pytest.raises(CapacityError, match=r"a put of 1 rows / 10000056 bytes into 'p' can never fit "
                                            r"\(capacity None rows / 1000 bytes\); split the put"):
        c.put({"s": ["x" * 10_000_000]}, "p", timeout=5)
    assert _used(tq) == before
    assert c.status("p")["rows"] == 1


def test_strings_fill_a_unit_and_the_next_put_waits_for_room(tq_factory):
    tq = tq_factory(max_bytes_per_unit=1000)
    c = tq.client
    c.create_partition("p")
    meta = c.put({"s": ["a" * 300, "b" * 300]}, "p")
    assert _used(tq) == (2, 2 * (300 + OVERHEAD))
    with pytest.raises(CapacityError, match=r"stayed full .*bytes 712/1000"):
        c.put({"s": ["c" * 300]}, "p", timeout=0.3)
    c.clear_rows(meta)
    c.put({"s": ["c" * 300]}, "p", timeout=1)  # the clear made room
    assert _used(tq) == (1, 300 + OVERHEAD)


def test_object_items_other_than_strings_count_their_json(tq_factory):
    tq = tq_factory()
    tq.client.create_partition("p")
    tq.client.put({"m": ObjectColumn([{"a": [1, 2]}, 7, None])}, "p")
    assert _used(tq) == (3, len('{"a":[1,2]}') + 8 + 8 + 3 * OVERHEAD)
