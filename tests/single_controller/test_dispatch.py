"""Pure logic of the single controller, no processes: dispatch modes, layouts,
placement, the wire format of arguments."""
from __future__ import annotations

import pytest
import torch

from asyncflow.single_controller import DISPATCH_MODES, Dispatch, GroupLayout, RolePlacement, register
from asyncflow.single_controller.dispatch import get_dispatch_mode, method_spec
from asyncflow.single_controller.wire import from_wire, to_wire
from asyncflow.transfer_queue import BatchMeta


def meta(n: int) -> BatchMeta:
    return BatchMeta("p", list(range(100, 100 + n)), ["x"])


def test_layout_shards_and_peers():
    lay = GroupLayout("actor", (4, 5, 6, 7), dp_size=2)
    assert lay.shard_size == 2 and [lay.shard_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert lay.shard_ranks(1) == [6, 7] and lay.dp_peers(1) == [5, 7]
    assert [lay.is_leader(i) for i in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="does not divide"):
        GroupLayout("actor", (0, 1, 2), dp_size=2)


def test_one_to_all_and_all_to_all():
    lay = GroupLayout("r", (0, 1), 2)
    assert get_dispatch_mode(Dispatch.ONE_TO_ALL).split(lay, (1,), {"a": 2}) == [((1,), {"a": 2})] * 2
    a2a = get_dispatch_mode(Dispatch.ALL_TO_ALL)
    assert a2a.split(lay, ([1, 2],), {"k": ["a", "b"]}) == [((1,), {"k": "a"}), ((2,), {"k": "b"})]
    with pytest.raises(ValueError, match="argument 0 must be a list of 2"):
        a2a.split(lay, (5,), {})


def test_rank_zero_calls_only_the_first_rank():
    rz = get_dispatch_mode(Dispatch.RANK_ZERO)
    lay = GroupLayout("r", (3, 4, 5), 3)
    assert rz.split(lay, (), {}) == [((), {}), None, None]
    assert rz.gather(lay, ["r3", None, None]) == "r3"


def test_dp_compute_split_and_gather():
    dp = get_dispatch_mode(Dispatch.DP_COMPUTE)
    lay = GroupLayout("r", (0, 1, 2, 3), dp_size=2)  # shards [0, 1] and [2, 3]
    calls = dp.split(lay, (meta(5), "extra"), {"k": 1})
    parts = [c[0][0] for c in calls]
    assert parts[0].rows == parts[1].rows == [100, 101, 102] and parts[2].rows == parts[3].rows == [103, 104]
    assert all(c[0][1] == "extra" and c[1] == {"k": 1} for c in calls)
    out = dp.gather(lay, [parts[0].with_columns(["y"]), None, parts[2].with_columns(["y"]), None])
    assert out.rows == list(range(100, 105)) and out.columns == ["y"]
    with pytest.raises(TypeError, match="first argument must be a BatchMeta"):
        dp.split(lay, ("not a meta",), {})


def test_register_marks_methods_and_rejects_unknown_modes():
    @register(Dispatch.RANK_ZERO, timeout_s=3)
    def f():
        pass
    assert method_spec(f).mode == "rank_zero" and method_spec(f).timeout_s == 3
    assert set(DISPATCH_MODES) >= {"one_to_all", "all_to_all", "rank_zero", "dp_compute"}
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        register("sideways")


def test_placement():
    assert RolePlacement().ranks_for("actor", 3) == [0, 1, 2]
    p = RolePlacement("disaggregated", roles={"rollout": [0], "actor": [1, 2]}, dp_size={"actor": 1})
    assert p.ranks_for("actor", 3) == [1, 2] and p.dp_size_for("actor", 2) == 1 and p.dp_size_for("rollout", 1) == 1
    with pytest.raises(ValueError, match="no ranks for role 'critic'"):
        p.ranks_for("critic", 3)
    with pytest.raises(ValueError, match=r"placement.roles.actor"):
        p.ranks_for("actor", 2)
    with pytest.raises(ValueError, match="placement.mode"):
        RolePlacement("scattered")


def test_wire_round_trip():
    m = BatchMeta("p", [1, 2], ["a"], groups=[0, 0], tokens=[3, 4])
    x = from_wire(to_wire({"m": m, "t": (1, torch.ones(2)), "l": [m]}))
    assert x["m"] == m and x["l"][0] == m and x["t"][0] == 1 and torch.equal(x["t"][1], torch.ones(2))
    with pytest.raises(TypeError, match="cannot be sent"):
        to_wire({"o": object()})


class _FakeTQ:
    """What DP_COMPUTE's leader reads through: records which read it used."""

    def __init__(self):
        self.reads: list[str] = []

    def get_data(self, meta):
        self.reads.append("get_data")
        return {"td": len(meta)}

    def get_columns(self, meta):
        self.reads.append("get_columns")
        return {"cols": len(meta)}

    def put(self, out, partition, meta):
        return meta.with_columns(list(out))


class _FakeWorker:
    is_shard_leader, shard_group = True, None

    def __init__(self):
        self.tq = _FakeTQ()
        self.seen = []

    @register(Dispatch.DP_COMPUTE)
    def as_tensordict(self, data):
        self.seen.append(data)
        return {"y": [1]}

    @register(Dispatch.DP_COMPUTE, columns=True)
    def as_columns(self, data):
        self.seen.append(data)
        return {"y": [1]}


def test_dp_compute_reads_columns_only_for_methods_that_ask():
    """columns=True: the leader reads the rows' columns (no TensorDict built); the default still
    hands the method get_data's TensorDict. Both write the method's columns back."""
    execute = get_dispatch_mode(Dispatch.DP_COMPUTE).execute
    w = _FakeWorker()
    assert execute(w, w.as_tensordict, (meta(3),), {}).columns == ["y"]
    assert execute(w, w.as_columns, (meta(2),), {}).columns == ["y"]
    assert w.tq.reads == ["get_data", "get_columns"] and w.seen == [{"td": 3}, {"cols": 2}]
    assert method_spec(w.as_columns).columns and not method_spec(w.as_tensordict).columns
    with pytest.raises(ValueError, match="columns=True is for DP_COMPUTE"):
        register(Dispatch.ONE_TO_ALL, columns=True)
