"""get_batch: get_meta and get_data in one hop when the controller's process holds the rows.
The same rows, bytes and consumption as the two calls; the two-hop path when a unit is
elsewhere or a read fails; bad requests consume nothing."""
from __future__ import annotations

import pytest
import torch

from asyncflow.transfer_queue import BadPutError, MissingColumnError, RowsClearedError


def _data(n, base=0):
    keys = list(range(base, base + n))
    return {"key": torch.tensor(keys), "tok": [torch.arange(k % 5 + 1) + 10 * k for k in keys],
            "text": [f"t{k}" for k in keys]}


def _check(td, meta, keys_of):
    assert td.batch_size == torch.Size([len(meta)])
    for i, r in enumerate(meta.rows):
        k = keys_of[r]
        assert int(td["key"][i]) == k and td["tok"][i].tolist() == (torch.arange(k % 5 + 1) + 10 * k).tolist()


def _calls(tq):
    return tq.on_loop(lambda: dict(tq.controller.stats))


def test_one_hop_returns_the_rows_get_meta_would_and_consumes_them_once(tq):
    tq.client.create_partition("p")
    put = tq.client.put(_data(10), "p")
    keys_of = dict(zip(put.rows, range(10)))
    meta, td = tq.client.get_batch(["key", "tok"], 4, "train", "p")
    assert meta.rows == put.rows[:4] and meta.columns == ["key", "tok"] and meta.tokens == put.tokens[:4]
    assert set(td.keys()) == {"key", "tok"}
    _check(td, meta, keys_of)
    # The next batch starts after them, for this task only; other tasks see every row.
    meta2 = tq.client.get_meta(["key"], 6, "train", "p")
    assert meta2.rows == put.rows[4:]
    other, td2 = tq.client.get_batch(["key", "tok"], 10, "ref", "p")
    assert other.rows == put.rows
    _check(td2, other, keys_of)


def test_data_columns_may_differ_from_the_columns_that_select_rows(tq):
    tq.client.create_partition("p")
    tq.client.put(_data(3), "p")
    meta, td = tq.client.get_batch(["key"], 3, "t", "p", data_columns=["text", "tok"])
    assert meta.columns == ["key"] and set(td.keys()) == {"text", "tok"}
    assert list(td["text"]) == ["t0", "t1", "t2"]


def test_the_async_client_and_a_partial_or_empty_batch(tq):
    from _tq_helpers import run_async
    tq.client.create_partition("p")
    tq.client.put(_data(2), "p")

    async def go():
        c = tq.async_client()
        try:
            meta, td = await c.get_batch(["key", "tok"], 5, "t", "p", allow_partial=True)
            assert len(meta) == 2 and td["key"].tolist() == [0, 1]
            empty, none = await c.get_batch(["key"], 5, "t", "p", allow_partial=True)
            assert len(empty) == 0 and none is None
        finally:
            await c.close()
    run_async(go())


def test_rows_on_several_units_and_columns_written_off_home(tq_factory):
    tq = tq_factory(num_local_units=2)
    tq.client.create_partition("p")
    node0, node1 = tq.new_client(preferred_unit=0), tq.new_client(preferred_unit=1)
    a, b = node0.put(_data(4), "p"), node1.put(_data(4, base=4), "p")
    keys_of = dict(zip(a.rows + b.rows, range(8)))
    meta = node1.get_meta(["key"], 8, "score", "p")
    node1.put({"score": torch.tensor([keys_of[r] * 0.5 for r in meta.rows])}, "p", meta)
    got, td = tq.client.get_batch(["key", "tok", "score"], 8, "train", "p")
    assert sorted(got.rows) == sorted(keys_of)
    _check(td, got, keys_of)
    assert td["score"].tolist() == [keys_of[r] * 0.5 for r in got.rows]


def test_a_unit_in_another_process_is_read_in_a_second_hop(tq):
    """The controller only reads units of its own process; for others it sends the meta alone
    and the client reads as get_data does."""
    tq.client.create_partition("p")
    tq.client.put(_data(3), "p")
    real = tq.on_loop(lambda: tq.controller.units[0])

    class Remote:  # stands for an RpcClient to a unit process: same calls, not local
        address = "elsewhere"

        async def call(self, method, /, _timeout=None, **args):
            return await real.call(method, _timeout=_timeout, **args)

    tq.on_loop(lambda: tq.controller.units.__setitem__(0, Remote()))
    try:
        meta, td = tq.client.get_batch(["key", "tok"], 3, "t", "p")
        assert td["key"].tolist() == [0, 1, 2]
    finally:
        tq.on_loop(lambda: tq.controller.units.__setitem__(0, real))


def test_bad_requests_fail_clearly_and_consume_nothing(tq):
    tq.client.create_partition("p")
    tq.client.put(_data(3), "p")
    with pytest.raises(BadPutError, match="no data columns"):
        tq.client.get_batch(["key"], 3, "t", "p", data_columns=[])
    with pytest.raises(BadPutError, match="no data columns"):
        tq.client.get_batch([], 3, "t", "p")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        tq.client.get_batch(["key"], 0, "t", "p")
    # A data column that does not exist: the rows were handed out (as get_meta would), the
    # read says what is missing.
    with pytest.raises(MissingColumnError, match="no column 'nope'"):
        tq.client.get_batch(["key"], 1, "t", "p", data_columns=["nope"])
    meta, td = tq.client.get_batch(["key"], 2, "t", "p")
    assert td["key"].tolist() == [1, 2]


def test_a_failing_read_is_reported_by_the_second_hop(tq):
    """The in-process read failing (here: rows whose bytes were dropped) sends the meta
    alone; the client's own read then raises the unit's error."""
    tq.client.create_partition("p")
    tq.client.put(_data(3), "p")
    unit = tq.service.units[0]

    def gone(*_, **__):  # the unit's read, which the fused read and rpc_get both use
        raise RowsClearedError("rows [0] were cleared")
    tq.on_loop(lambda: setattr(unit, "read", gone))
    with pytest.raises(RowsClearedError, match="were cleared"):
        tq.client.get_batch(["key"], 3, "t", "p")


def _without_suspending(coro):
    """The value of a coroutine that must finish without suspending once (as RpcServer then
    answers it inline, with no task)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the call suspended")


def test_put_and_get_batch_with_rows_ready_never_suspend():
    from asyncflow.rpc.codec import decode, encode
    from asyncflow.rpc.local_endpoint import LocalEndpoint
    from asyncflow.transfer_queue.client import _batch_reply, _plan_put
    from asyncflow.transfer_queue.controller import Controller
    from asyncflow.transfer_queue.storage import StorageUnit

    controller = Controller()
    unit = StorageUnit(0, LocalEndpoint(controller))
    controller.attach_unit(0, LocalEndpoint(unit), "unit-0")
    _without_suspending(controller.rpc_create_partition("p"))
    _, calls = _plan_put(_data(6), "p", None, None)
    put = _without_suspending(unit.rpc_put(**decode(encode(calls[0][1]))))
    reply = _without_suspending(controller.rpc_get_batch("p", "t", ["key", "tok"], 6))
    meta, cols = _batch_reply(decode(encode(reply)), ["key", "tok"])
    assert meta.rows == list(range(put["first"], put["first"] + 6))
    assert cols["key"].data.tolist() == list(range(6))
    assert reply["reads"][0]["pos"] is None  # one read of every row: no positions to send


def test_the_blocking_client_hands_out_the_columns_themselves_and_rows_reads_them_as_get_data_s(tq):
    from asyncflow.transfer_queue.columns import JaggedColumn, ObjectColumn
    from asyncflow.transfer_queue.row_lists import rows, values
    tq.client.create_partition("p")
    tq.client.put(_data(5), "p")
    meta, cols = tq.client.get_batch_columns(["key"], 5, "t", "p", data_columns=["key", "tok", "text"])
    assert isinstance(cols["tok"], JaggedColumn) and isinstance(cols["text"], ObjectColumn)
    td = tq.client.get_data(meta, ["key", "tok", "text"])
    assert [r.tolist() for r in rows(cols["tok"])] == [r.tolist() for r in rows(td["tok"])]
    assert values(cols["text"]) == values(td["text"]) == [f"t{k}" for k in range(5)]
    assert values(cols["key"]) == values(td["key"]) == list(range(5))
    assert [int(r) for r in rows(cols["key"])] == list(range(5))
    empty, none = tq.client.get_batch_columns(["key"], 5, "t", "p", allow_partial=True)  # all consumed
    assert not empty.rows and none is None
