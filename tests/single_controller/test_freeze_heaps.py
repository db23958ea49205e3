"""A rank keeps what it built out of later garbage collections: what its workers made while
their group was created, and, when the driver asks every rank (``Driver.freeze_heaps``, the
trainer before its RL loop), what they made since. Ranks are processes of their own
(LocalWorkers, started as the launcher starts them), so the freeze is theirs, not the test's."""
from __future__ import annotations

import gc

import _sc_workers as W

from asyncflow.rpc.alloc import refreeze_gc_heap


def test_a_group_built_and_objects_made_later_leave_the_collections(cluster3):
    d = cluster3.driver

    async def run():
        heap = await d.create_group(W.HeapWorker, "heap", ranks=[0, 1], n=20_000)
        at_creation = await heap.heap()
        await heap.build(30_000)
        built = await heap.heap()
        frozen = await d.freeze_heaps()
        return at_creation, built, frozen, await heap.heap()

    at_creation, built, frozen, after = cluster3.run(run())
    for rank in range(2):
        # objects made in __init__ were frozen once the group was built
        assert at_creation[rank]["kept"] == 20_000 and at_creation[rank]["walked"] == 0
        # objects made by a later call are walked until the driver asks
        assert built[rank]["walked"] == 30_000
        assert after[rank]["walked"] == 0 and after[rank]["kept"] == 50_000
        assert after[rank]["frozen"] >= built[rank]["frozen"] + 30_000
    assert len(frozen) == 3 and all(f > 0 for f in frozen)  # every rank of the cluster answered


def test_a_process_that_never_froze_is_left_alone():
    # this test's own process: no launcher froze it, so nothing of pytest's is kept forever
    before = gc.get_freeze_count()
    assert refreeze_gc_heap() == 0
    assert gc.get_freeze_count() == before
