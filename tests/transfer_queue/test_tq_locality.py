"""Writers use the storage unit of their own node: new rows and the columns they add to
rows that live elsewhere. The controller records where such columns are, metas carry it,
reads follow it; clears reach every unit that holds a cell; a dead unit is named."""
from __future__ import annotations

import random
import socket

import pytest
import torch

from asyncflow.transfer_queue import (
    BadPutError,
    BatchMeta,
    RowsClearedError,
    TransferQueueClient,
    TransferQueueTimeout,
    locality,
)
from asyncflow.transfer_queue.meta import make_row_id, unit_of


def _prompts(keys):
    return {"key": torch.tensor(keys), "prompt": [torch.full((1 + k % 5,), k) for k in keys]}


def _responses(keys):
    return {"resp": [torch.arange(k % 7 + 1) + 1000 * k for k in keys], "score": torch.tensor(keys) * 0.5}


def _stats(tq):
    return {s["unit"]: s for s in tq.client.unit_stats()}


@pytest.fixture
def two_nodes(tq_factory):
    """One service with units 0 and 1, standing for the units of nodes 0 and 1."""
    tq = tq_factory(num_local_units=2)
    tq.client.create_partition("p")
    return tq, tq.new_client(preferred_unit=0, node=0), tq.new_client(preferred_unit=1, node=1)


def test_columns_added_on_another_node_are_stored_there_and_read_back(two_nodes):
    tq, node0, node1 = two_nodes
    keys = list(range(12))
    created = node0.put(_prompts(keys), "p")
    assert {unit_of(r) for r in created.rows} == {0}  # the driver's node creates the rows at home
    # "The rollout on node 1": takes the rows, writes its responses into its own unit.
    meta = node1.get_meta(["key", "prompt"], 12, "rollout", "p")
    keys_of = dict(zip(meta.rows, node1.get_data(meta, ["key"])["key"].tolist()))
    back = node1.put(_responses([keys_of[r] for r in meta.rows]), "p", meta)
    assert back.locations == {"resp": [1] * 12, "score": [1] * 12}
    st = _stats(tq)
    assert st[1]["put_rows_by_node"] == {"1": 12} and st[1]["rows"] == 0 and st[1]["foreign_rows"] == 12
    assert st[0]["put_rows_by_node"] == {"0": 12} and st[0]["rows"] == 12
    # A consumer anywhere: the meta names unit 1 for the responses, unit 0 (home) for the prompts.
    got = tq.client.get_meta(["prompt", "resp", "score", "key"], 12, "train", "p")
    assert set(got.locations) == {"resp", "score"} and set(got.locations["resp"]) == {1}
    td = tq.client.get_data(got)
    for i, k in enumerate(td["key"].tolist()):
        assert td["prompt"][i].tolist() == [k] * (1 + k % 5)
        assert td["resp"][i].tolist() == (torch.arange(k % 7 + 1) + 1000 * k).tolist()
        assert float(td["score"][i]) == k * 0.5


def test_mixed_homes_and_any_row_order(two_nodes):
    tq, node0, node1 = two_nodes
    m0 = node0.put(_prompts(list(range(10))), "p")
    m1 = node1.put(_prompts(list(range(100, 108))), "p")
    both = BatchMeta.concat([m0, m1])
    keys = list(range(10)) + list(range(100, 108))
    out = node1.put(_responses(keys), "p", both)  # home-1 rows at home, home-0 rows off-home
    assert out.locations["resp"] == [1] * 18
    assert _stats(tq)[1]["foreign_rows"] == 10
    rng = random.Random(3)
    for _ in range(3):
        perm = list(range(18))
        rng.shuffle(perm)
        sel = out.select(perm)
        cols = tq.client.get_columns(sel, ["key", "resp", "prompt"])
        want = [keys[i] for i in perm]
        assert cols["key"].data.tolist() == want
        assert [cols["resp"].row(i).tolist() for i in range(18)] == [
            (torch.arange(k % 7 + 1) + 1000 * k).tolist() for k in want]
    # Written by node 0 instead: the columns go to unit 0, wherever the rows live.
    out0 = node0.put({"adv": torch.ones(18)}, "p", both)
    assert out0.locations["adv"] == [0] * 18
    assert tq.client.get_data(out0, ["adv"])["adv"].tolist() == [1.0] * 18


def test_a_column_the_meta_does_not_list_is_located_through_the_controller(two_nodes):
    tq, node0, node1 = two_nodes
    created = node0.put(_prompts([1, 2, 3]), "p")
    node1.put(_responses([1, 2, 3]), "p", created)
    # ``created`` lists only key/prompt: the reader asks the controller where "resp" is.
    cols = node0.get_columns(created, ["resp", "key"])
    assert [cols["resp"].row(i).tolist() for i in range(3)] == [
        (torch.arange(k % 7 + 1) + 1000 * k).tolist() for k in (1, 2, 3)]


def test_clears_free_the_cells_stored_off_home(two_nodes):
    tq, node0, node1 = two_nodes
    created = node0.put(_prompts(list(range(8))), "p")
    node1.put(_responses(list(range(8))), "p", created)
    assert _stats(tq)[1]["bytes"] > 0
    assert tq.client.clear_rows(created.select([0, 1, 2])) == 3
    st = _stats(tq)
    assert st[1]["foreign_rows"] == 5 and st[0]["rows"] == 5
    rest = created.select(range(3, 8))
    assert tq.client.get_columns(rest, ["score"])["score"].data.tolist() == [k * 0.5 for k in range(3, 8)]
    assert tq.client.clear("p") == 5
    st = _stats(tq)
    assert all(s["bytes"] == 0 and s["rows"] == 0 and s["foreign_rows"] == 0 and s["batches"] == 0
               for s in st.values()), st


def test_refused_off_home_writes_leave_no_trace(two_nodes):
    tq, node0, node1 = two_nodes
    created = node0.put(_prompts([1, 2]), "p")
    node1.put({"resp": [torch.ones(2), torch.ones(3)]}, "p", created)
    before = _stats(tq)[1]
    # A column is written once per row, whichever unit a second writer uses.
    with pytest.raises(BadPutError, match="already have column 'resp'"):
        node0.put({"resp": [torch.ones(2), torch.ones(3)]}, "p", created)
    with pytest.raises(BadPutError, match="already have column 'resp'"):
        node1.put({"resp": [torch.ones(2), torch.ones(3)]}, "p", created)
    # Rows the controller does not know: refused there, taken back from the unit.
    ghost = BatchMeta("p", [make_row_id(0, 999)], ["key"])
    with pytest.raises(RowsClearedError, match="do not exist"):
        node1.put({"x": torch.ones(1)}, "p", ghost)
    after = _stats(tq)[1]
    for k in ("bytes", "batches", "foreign_rows", "put_rows_by_node"):
        assert after[k] == before[k], k


def test_meta_locations_survive_select_concat_and_the_wire():
    a = BatchMeta("p", [make_row_id(0, 1), make_row_id(0, 2)], ["x"], locations={"x": [1, 1]})
    b = BatchMeta("p", [make_row_id(1, 5)], ["x"])
    both = BatchMeta.concat([a, b])
    assert both.locations == {"x": [1, 1, 1]}
    assert both.select([2, 0]).locations == {"x": [1, 1]}
    assert BatchMeta.from_wire(both.to_wire()) == both
    assert both.unit_of_column("y") == [0, 0, 1]
    assert "locations" not in b.to_wire()  # nothing extra on the wire when all is at home
    assert b.stored_at(["z"], 1).locations == {} and a.stored_at(["z"], 1).locations["z"] == [1, 1]


def test_process_locality_is_the_default_of_new_clients(tq_factory):
    tq = tq_factory(num_local_units=2)
    tq.client.create_partition("p")
    locality.set_locality(1, 1)
    try:
        c = tq.new_client()
        assert c.node == 1
        assert {unit_of(r) for r in c.put(_prompts([1, 2, 3]), "p").rows} == {1}
    finally:
        locality.set_locality(None, None)
    c = tq.new_client()
    assert c.node is None
    rows = [unit_of(r) for _ in range(4) for r in c.put(_prompts([1]), "p").rows]
    assert sorted(set(rows)) == [0, 1]  # no locality: new rows are spread over the units


def test_a_dead_unit_is_named_by_a_read_that_times_out(tq):
    with socket.socket() as s:  # an address where nothing answers
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    tq.client.controller.call("register_unit", index=5, address=dead)
    c = TransferQueueClient(tq.address, timeout=1.0, wait_timeout=1.0)
    try:
        with pytest.raises(TransferQueueTimeout, match=r"storage unit 5 \(tcp://127.0.0.1:\d+\) did not answer"):
            c.get_data(BatchMeta("p", [make_row_id(5, 0)], ["x"]))
    finally:
        c.close()


def test_off_home_columns_arriving_out_of_row_order(two_nodes):
    """Rollout instances finish in any order: a unit keeps another unit's rows whichever
    arrive first (its index of them grows down as well as up)."""
    tq, node0, node1 = two_nodes
    created = node0.put(_prompts(list(range(30))), "p")
    for part in ([20, 30], [0, 5], [10, 20], [5, 10]):
        node1.put(_responses(list(range(*part))), "p", created.select(range(*part)))
    assert _stats(tq)[1]["foreign_rows"] == 30
    got = tq.client.get_meta(["key", "resp"], 30, "train", "p")
    td = tq.client.get_data(got)
    for i, k in enumerate(td["key"].tolist()):
        assert td["resp"][i].tolist() == (torch.arange(k % 7 + 1) + 1000 * k).tolist()


def test_unit_stats_lists_every_unit_in_order_for_both_clients(two_nodes):
    from _tq_helpers import run_async
    tq, node0, node1 = two_nodes
    node1.put(_prompts([1, 2, 3]), "p")  # three rows in unit 1, none in unit 0
    stats = tq.client.unit_stats()
    assert [s["unit"] for s in stats] == [0, 1] and [s["rows"] for s in stats] == [0, 3]

    async def go():
        c = tq.async_client()
        try:
            return await c.unit_stats()
        finally:
            await c.close()
    assert run_async(go()) == stats
    fresh = tq.new_client()
    assert fresh.unit_stats() == stats
    assert not fresh._endpoints  # one request to the controller: no unit was asked, or even connected
