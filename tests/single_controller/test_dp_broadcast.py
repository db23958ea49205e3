"""DP_COMPUTE's representative rule over a real 4-rank gloo cluster: the leader of each
data shard reads its share from the TransferQueue once and broadcasts it to the rest of
its shard; the other ranks never read the TransferQueue, yet see the same data."""
from __future__ import annotations

import threading

import _dp_workers as D
import pytest
import torch
from _sc_cluster import cluster_fixture

pytestmark = pytest.mark.slow
cluster4 = cluster_fixture(4)


class _CountReads:
    """Records every read of the (in-process) storage unit: ``(partition, rows, columns)``.
    Every path to a unit's bytes (its rpc_get, the controller's fused get_batch) goes
    through ``StorageUnit.read``, so reads by any rank, through any client call, show here."""

    def __init__(self, unit):
        self.unit, self.reads, self._lock = unit, [], threading.Lock()

    def __enter__(self) -> _CountReads:
        original = self.unit.read

        def read(partition, row_t, columns):
            with self._lock:
                self.reads.append((partition, [int(r) for r in row_t.tolist()], list(columns)))
            return original(partition, row_t, columns)
        self.unit.read = read  # instance attribute: shadows the method for this unit only
        return self

    def __exit__(self, *exc) -> None:
        del self.unit.read


def test_only_shard_leaders_read_the_transfer_queue(cluster4):
    """4 ranks in 2 shards of 2 ([0, 1], [2, 3]; leaders 0 and 2): one read per shard, not
    per rank, and both ranks of a shard compute on identical data."""
    c = cluster4
    assert len(c.tq.units) == 1  # every row below lives in the unit we count
    x = torch.arange(9) + 100
    v = torch.arange(27, dtype=torch.float32).reshape(9, 3) / 4

    async def make_and_put():
        wg = await c.driver.create_group(D.DpWorker, "dp", ranks=[0, 1, 2, 3], dp_size=2)
        tq = c.tq_client()
        await tq.create_partition("bcast")
        meta = await tq.put({"x": x, "v": v}, "bcast")
        await tq.close()
        return wg, meta
    wg, meta = c.run(make_and_put())
    shard_rows = [meta.rows[:5], meta.rows[5:]]  # meta.chunk(2): 5 and 4 rows

    with _CountReads(c.tq.units[0]) as counter:
        out = c.run(wg.take(meta))
    reads = [r for r in counter.reads if r[0] == "bcast"]
    assert len(reads) == 2, f"{len(reads)} reads of the TransferQueue for 2 shards of 2 ranks: {reads}"
    assert sorted(rows for _, rows, _ in reads) == sorted(shard_rows), reads
    assert all(sorted(cols) == ["v", "x"] for _, _, cols in reads), reads

    seen = c.run(wg.seen())
    assert [(s["rank"], s["dp_rank"], s["leader"]) for s in seen] == \
        [(0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False)]
    assert all(len(s["taken"]) == 1 for s in seen), seen
    expect = [{"v": v[:5].tolist(), "x": x[:5].tolist()}, {"v": v[5:].tolist(), "x": x[5:].tolist()}]
    for s in seen:  # a non-leader got its leader's data by broadcast: the same, whole
        assert s["taken"][0] == expect[s["dp_rank"]], (s["rank"], s["taken"][0])

    async def written():
        tq = c.tq_client()
        got = await tq.get_data(out, ["y", "y_rank"])
        await tq.close()
        return got
    y = c.run(written())
    assert out.rows == meta.rows and out.columns == ["y", "y_rank"]
    assert y["y"].tolist() == (x * 10).tolist()
    assert y["y_rank"].tolist() == [0] * 5 + [2] * 4  # each shard's leader wrote its rows back
