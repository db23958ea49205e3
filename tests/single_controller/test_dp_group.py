"""A worker's three process groups over a real 4-rank gloo cluster, checked by an
all_reduce over each in which rank r adds ``1 << r`` (the sum names the ranks that took
part): ``dp_group`` holds exactly this rank's DP peers (``GroupLayout.dp_peers`` of its
position in the shard), ``shard_group`` its shard, ``process_group`` the whole group; a
rank alone in a group gets None."""
from __future__ import annotations

import _dp_workers as D
import pytest
from _sc_cluster import cluster_fixture

from asyncflow.single_controller import GroupLayout

pytestmark = pytest.mark.slow
cluster4 = cluster_fixture(4)


def _expected(layout: GroupLayout) -> list[dict]:
    out = []
    for index, rank in enumerate(layout.ranks):
        peers = layout.dp_peers(index % layout.shard_size)
        shard = layout.shard_ranks(layout.shard_of(index))
        out.append({"rank": rank, "dp": sorted(peers) if len(peers) > 1 else None,
                    "shard": sorted(shard) if len(shard) > 1 else None, "whole": sorted(layout.ranks)})
    return out


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [2, 0, 3, 1]], ids=["in-order", "shuffled"])
def test_dp_group_spans_exactly_the_dp_peers(cluster4, ranks):
    """2 shards of 2. In order: shards [0, 1] and [2, 3], DP peers [0, 2] and [1, 3].
    Shuffled (group order is not global-rank order): shards [2, 0] and [3, 1], DP peers
    [2, 3] and [0, 1]: groups built from group indices instead of global ranks would show."""
    c = cluster4
    role = "dp-" + "".join(map(str, ranks))
    layout = GroupLayout(role, tuple(ranks), 2)

    async def go():
        wg = await c.driver.create_group(D.DpWorker, role, ranks=ranks, dp_size=2)
        return await wg.members(_timeout=10)  # a mis-wired group hangs its collective
    got = c.run(go())
    assert got == _expected(layout)
    # dp_group is neither this rank's shard nor the whole group
    assert all(g["dp"] != g["shard"] and g["dp"] != g["whole"] for g in got), got
    if ranks == [0, 1, 2, 3]:  # spelled out once, in case dp_peers itself were misread
        assert [g["dp"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        assert [g["shard"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_a_rank_alone_gets_no_group(cluster4):
    """dp_size 1 (one shard of 2): each rank is alone at its position, so dp_group is None;
    dp_size 2 of 2 ranks (shards of 1): dp_group is the whole group, shard_group None."""
    c = cluster4

    async def go():
        one = await c.driver.create_group(D.DpWorker, "one-shard", ranks=[1, 3], dp_size=1)
        two = await c.driver.create_group(D.DpWorker, "two-shards", ranks=[1, 3], dp_size=2)
        return await one.members(_timeout=10), await two.members(_timeout=10)
    one, two = c.run(go())
    assert one == [{"rank": r, "dp": None, "shard": [1, 3], "whole": [1, 3]} for r in (1, 3)]
    assert two == [{"rank": r, "dp": [1, 3], "shard": None, "whole": [1, 3]} for r in (1, 3)]
