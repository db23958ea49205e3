"""StorageUnit.read: rows read as they were put come back as views of the stored tensors;
every other shape of request (ids across two puts, out of order, with a hole, a column
added later in another order) comes back right, or fails naming the rows."""
from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow.rpc.local_endpoint import LocalEndpoint
from asyncflow.transfer_queue.columns import column_from_wire, column_to_wire, to_column
from asyncflow.transfer_queue.controller import Controller
from asyncflow.transfer_queue.errors import BadPutError, MissingColumnError, RowsClearedError
from asyncflow.transfer_queue.meta import make_row_id
from asyncflow.transfer_queue.storage import StorageUnit

PART = "p"


def _put_rows(unit: StorageUnit, lo: int, n: int) -> torch.Tensor:
    """n new rows whose "ids" row i holds i+lo repeated (i % 5) + 1 times and "x" = i+lo."""
    rows = [torch.full(((i % 5) + 1,), i, dtype=torch.long) for i in range(lo, lo + n)]
    cols = {"ids": column_to_wire(to_column("ids", rows)),
            "x": column_to_wire(to_column("x", torch.arange(lo, lo + n)))}
    reply = asyncio.run(unit.rpc_put(PART, cols))
    return torch.arange(reply["first"], reply["first"] + reply["n"])


def _read(unit: StorageUnit, rows, columns=("ids", "x")) -> dict:
    got = unit.read(PART, torch.as_tensor(rows, dtype=torch.long), list(columns))
    return {k: column_from_wire(w) for k, w in got.items()}


def _expect(cols: dict, values: list[int]) -> None:
    assert cols["x"].data.tolist() == values
    assert [cols["ids"].row(i).tolist() for i in range(len(values))] == [[v] * ((v % 5) + 1) for v in values]


@pytest.fixture
def unit():
    ctrl = Controller(default_timeout=5.0)
    u = StorageUnit(0, LocalEndpoint(ctrl, "controller"))
    asyncio.run(ctrl.rpc_create_partition(PART))
    return u


def test_rows_read_as_put_are_views_of_the_stored_tensors(unit):
    ids = _put_rows(unit, 0, 8)
    stored = next(iter(unit.batches.values())).columns
    whole = _read(unit, ids)
    _expect(whole, list(range(8)))
    assert whole["x"].data is stored["x"].data  # the put's own tensors: resent as received
    middle = _read(unit, ids[2:6])
    _expect(middle, [2, 3, 4, 5])
    assert middle["ids"].values.data_ptr() == stored["ids"].values[stored["ids"].offsets[2]:].data_ptr()


def test_consecutive_ids_across_two_puts_and_out_of_order(unit):
    a = _put_rows(unit, 0, 4)
    b = _put_rows(unit, 4, 4)
    assert int(b[0]) == int(a[-1]) + 1  # one run of ids over two batches
    _expect(_read(unit, torch.cat([a, b])[2:7]), [2, 3, 4, 5, 6])
    _expect(_read(unit, torch.cat([a, b]).flip(0)), list(range(7, -1, -1)))


def test_a_dropped_row_inside_a_run_is_named(unit):
    ids = _put_rows(unit, 0, 6)
    asyncio.run(unit.rpc_drop_rows(PART, ids[3:4]))
    with pytest.raises(RowsClearedError, match=str(int(ids[3]))):
        _read(unit, ids)
    _expect(_read(unit, ids[:3]), [0, 1, 2])


def test_a_column_added_in_another_order_reads_by_row(unit):
    ids = _put_rows(unit, 0, 6)
    order = ids.flip(0)
    y = {"y": column_to_wire(to_column("y", order * 10))}
    asyncio.run(unit.rpc_put(PART, y, rows=order))
    got = _read(unit, ids, ("x", "y"))
    assert got["x"].data.tolist() == list(range(6))
    assert got["y"].data.tolist() == (ids * 10).tolist()


def test_rows_of_another_unit_or_never_stored_fail_clearly(unit):
    ids = _put_rows(unit, 0, 3)
    with pytest.raises(RowsClearedError, match="never stored"):
        _read(unit, torch.arange(int(ids[-1]) + 1, int(ids[-1]) + 4))
    foreign = torch.tensor([make_row_id(1, 0), make_row_id(1, 1)])
    with pytest.raises(RowsClearedError):
        _read(unit, foreign)


def test_a_column_missing_or_not_yet_written_raises_missing_column_error(unit):
    ids = _put_rows(unit, 0, 4)
    asyncio.run(unit.rpc_put(PART, {"y": column_to_wire(to_column("y", torch.arange(2)))}, rows=ids[:2]))
    with pytest.raises(MissingColumnError,
                       match=r"'p' has no column 'nope' in unit 0 \(it holds \['ids', 'x', 'y'\]\)"):
        _read(unit, ids, ("x", "nope"))
    with pytest.raises(MissingColumnError, match=rf"rows \[{int(ids[2])}, {int(ids[3])}\] have no column 'y' yet"):
        _read(unit, ids, ("x", "y"))
    assert _read(unit, ids[:2], ("y",))["y"].data.tolist() == [0, 1]
    # A KeyError (so a LookupError) that prints its message unquoted; not the old classes.
    err = MissingColumnError("partition 'p' has no column 'j'")
    assert isinstance(err, KeyError) and isinstance(err, LookupError)
    assert not isinstance(err, (BadPutError, RowsClearedError))
    assert str(err) == "partition 'p' has no column 'j'"


def _state(unit: StorageUnit) -> tuple:
    stats = asyncio.run(unit.rpc_stats())
    return stats, {k: c.tolist() for ps in unit.parts.values() for k, c in ps.codes.items()}


@pytest.mark.parametrize("wire,err", [
    ({"k": "jagged", "values": torch.arange(3), "offsets": torch.tensor([0, 2, 10])}, "offsets end at 10"),
    ({"k": "jagged", "values": torch.arange(3), "offsets": torch.tensor([0, 3, 1, 3])}, "offsets decrease at row 1"),
    ({"k": "jagged", "values": torch.arange(3), "offsets": torch.tensor([0, 3], dtype=torch.int32)}, "int64"),
    ({"k": "fixed", "data": torch.tensor(7)}, "0-d tensor"),
    ({"k": "object", "items": "abc"}, "must be a list"),
    ({"k": "sparse"}, "unknown column kind"),
])
def test_unit_refuses_a_malformed_put_column_and_stores_nothing(unit, wire, err):
    ids = _put_rows(unit, 0, 3)
    before = _state(unit)
    good = {"x": column_to_wire(to_column("x", torch.arange(3)))}
    with pytest.raises(BadPutError, match=rf"put into 'p': column 'bad': .*{err}.*nothing was stored"):
        asyncio.run(unit.rpc_put(PART, {**good, "bad": wire}))
    with pytest.raises(BadPutError, match=rf"column 'bad': .*{err}"):  # columns added to existing rows
        asyncio.run(unit.rpc_put(PART, {"bad": wire}, rows=ids))
    assert _state(unit) == before
    _expect(_read(unit, ids), [0, 1, 2])


@pytest.mark.parametrize("put_sizes", [[1] * 40, [1, 2, 3] * 7, [20, 20]])
def test_reads_across_many_puts_in_any_order_come_back_right(unit, put_sizes):
    """Rows streamed in one or a few per put (a rollout's writes) and rows of a few large puts,
    read shuffled, in runs that cross puts, and backwards by twos: the runs path (views, one
    concat) and the per-batch gather (the shuffled read of two large puts) give the right rows."""
    ids, lo = [], 0
    for n in put_sizes:
        ids.append(_put_rows(unit, lo, n))
        lo += n
    ids = torch.cat(ids)
    gen = torch.Generator().manual_seed(0)
    orders = [torch.randperm(lo, generator=gen)[:k] for k in (2, 8, 17, lo)]
    orders.append(torch.cat([torch.arange(5, 12), torch.arange(0, 5), torch.arange(30, 40)]))  # runs across puts
    orders.append(torch.arange(lo - 1, -1, -2))
    for order in orders:
        _expect(_read(unit, ids[order]), order.tolist())
