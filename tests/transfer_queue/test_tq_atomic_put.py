"""A put that adds columns to rows of several storage units is all or nothing: the
controller checks it whole before any unit stores a byte, so a refused put leaves no part
behind in any unit, and a corrected retry succeeds. Both clients behave the same.
A put to one unit makes no extra round trip (that unit's notify checks it whole)."""
from __future__ import annotations

import re

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import BadPutError, BatchMeta, RowsClearedError, SchemaMismatchError
from asyncflow.transfer_queue.meta import unit_of


class _Blocking:
    """The blocking client behind the awaitable interface the scenarios use."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name):
        fn = getattr(self.client, name)

        async def call(*args, **kwargs):
            return fn(*args, **kwargs)
        return call

    async def close(self):
        pass  # the fixture closes it


async def _six_rows_on_two_units(c) -> BatchMeta:
    await c.create_partition("p")
    m0 = await c.put({"k": torch.arange(3)}, "p")
    m1 = await c.put({"k": torch.arange(3, 6)}, "p")  # round robin: the next unit
    assert {unit_of(r) for r in m0.rows} == {0} and {unit_of(r) for r in m1.rows} == {1}
    return BatchMeta.concat([m0, m1])


@pytest.fixture(params=["blocking", "async"])
def on_two_units(request, tq_factory):
    """``run(scenario)``: awaits ``scenario(c, meta)`` with a client ``c`` of a service with two
    units (clients have no preferred unit) and ``meta``, the rows of ``_six_rows_on_two_units``;
    the client is closed after."""
    tq = tq_factory(num_local_units=2)

    async def main(scenario):
        c = _Blocking(tq.client) if request.param == "blocking" else tq.async_client()
        try:
            await scenario(c, await _six_rows_on_two_units(c))
        finally:
            await c.close()
    return lambda scenario: H.run_async(main(scenario))


async def _state(c):
    return await c.status("p"), await c.unit_stats()


def _scores(n, dtype=torch.float32):
    """0.5, 1.5, ... (float) or 0, 1, ... (integer dtypes)."""
    values = torch.arange(n, dtype=dtype)
    return {"score": values + 0.5 if dtype.is_floating_point else values}


def test_put_to_two_units_with_a_cleared_row_stores_nothing_and_a_retry_without_it_succeeds(on_two_units):
    async def scenario(c, meta):
        gone = meta.rows[4]  # a row of unit 1
        assert await c.clear_rows(meta.select([4])) == 1
        before = await _state(c)
        with pytest.raises(RowsClearedError, match=rf"partition 'p': rows \[{gone}\] do not exist"):
            await c.put(_scores(6), "p", meta)
        after = await _state(c)
        assert after == before
        assert "score" not in after[0]["column_rows"]  # unit 0 kept no half
        keep = meta.select([0, 1, 2, 3, 5])
        await c.put(_scores(5), "p", keep)
        assert (await c.status("p"))["column_rows"]["score"] == 5
        got = await c.get_columns(keep.with_columns(["score"]))
        assert got["score"].data.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]
    on_two_units(scenario)


def test_put_to_two_units_with_a_schema_mismatch_stores_nothing(on_two_units):
    async def scenario(c, meta):
        await c.put(_scores(1), "p", meta.select([0]))  # fixes 'score' as float32
        before = await _state(c)
        rest = meta.select([1, 2, 3, 4, 5])
        with pytest.raises(SchemaMismatchError,
                           match=re.escape("'score': holds fixed float32[] but this put sends fixed int64[]")):
            await c.put(_scores(5, torch.int64), "p", rest)
        assert await _state(c) == before
        await c.put(_scores(5), "p", rest)
        assert (await c.status("p"))["column_rows"]["score"] == 6
    on_two_units(scenario)


def test_put_to_two_units_where_one_units_rows_already_have_the_column_stores_nothing(on_two_units):
    async def scenario(c, meta):
        await c.put(_scores(3), "p", meta.select([3, 4, 5]))  # unit 1's rows have it
        before = await _state(c)
        with pytest.raises(BadPutError, match=r"rows \[.*\] already have column 'score'; columns are written "
                                              r"once per row"):
            await c.put(_scores(6), "p", meta)
        assert await _state(c) == before
        assert (await c.status("p"))["column_rows"]["score"] == 3
    on_two_units(scenario)


def test_put_to_two_units_naming_a_row_twice_stores_nothing(on_two_units):
    async def scenario(c, meta):
        twice = BatchMeta.concat([meta, meta.select([0])])
        before = await _state(c)
        with pytest.raises(BadPutError, match=rf"names rows \[{meta.rows[0]}\] more than once"):
            await c.put(_scores(7), "p", twice)
        assert await _state(c) == before
    on_two_units(scenario)


def test_only_a_put_split_over_units_asks_the_controller_first(tq_factory):
    """The single-unit put (the throughput path) makes no extra round trip."""
    tq = tq_factory(num_local_units=2)
    c = tq.client
    meta = H.run_async(_six_rows_on_two_units(_Blocking(c)))
    checks = []
    ctrl = tq.controller
    real = ctrl.rpc_check_put

    async def counting(**kw):
        checks.append(kw["partition"])
        return await real(**kw)
    tq.on_loop(lambda: setattr(ctrl, "rpc_check_put", counting))
    c.put(_scores(2), "p", meta.select([0, 1]))  # unit 0 only
    assert checks == []
    tq.new_client(preferred_unit=1).put(_scores(2), "p", meta.select([3, 2]))  # one unit: the writer's
    assert checks == []
    c.put(_scores(2), "p", meta.select([4, 5]))
    assert checks == []
    c.put({"more": torch.zeros(6)}, "p", meta)  # both units
    assert checks == ["p"]
