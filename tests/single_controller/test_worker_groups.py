"""Worker groups over a real 3-rank gloo cluster: every dispatch mode, DP_COMPUTE through
a real TransferQueue, concurrent disaggregated groups, colocated role switching, remote
errors and call timeouts. One cluster serves the whole module (start-up is the cost)."""
from __future__ import annotations

import asyncio
import collections
import random
import time

import _sc_workers as W
import pytest
import torch

from asyncflow.single_controller import WorkerCallTimeout, WorkerError

pytestmark = pytest.mark.slow

MEET_S = 30.0  # the calls of a test are released by events; this only bounds a broken test's hang


def _wait_for_file(path, timeout_s: float = MEET_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture(scope="module")
def groups(cluster3):
    """echo: all 3 ranks, 3 shards; tp: ranks [1, 2] as one shard of 2; gen: rank [0]."""
    d = cluster3.driver

    async def make():
        echo = await d.create_group(W.EchoWorker, "echo", tag="t")
        tp = await d.create_group(W.EchoWorker, "tp", ranks=[1, 2], dp_size=1)
        gen = await d.create_group(W.EchoWorker, "gen", ranks=[0])
        return echo, tp, gen
    return cluster3.run(make())


def test_one_to_all(cluster3, groups):
    echo, tp, _ = groups
    who = cluster3.run(echo.whoami(x={"k": [1, 2]}))
    assert [w["rank"] for w in who] == [0, 1, 2]
    assert all(w["x"] == {"k": [1, 2]} and w["tag"] == "t" and w["role"] == "echo" for w in who)
    assert len({w["pid"] for w in who}) == 3
    assert [w["dp_rank"] for w in cluster3.run(tp.whoami())] == [0, 0]


def test_all_to_all(cluster3, groups):
    echo = groups[0]
    xs = [torch.arange(3) + i for i in range(3)]
    out = cluster3.run(echo.scale(xs, factor=[1, 10, 100]))
    assert [o.tolist() for o in out] == [[0, 1, 2], [10, 20, 30], [200, 300, 400]]
    with pytest.raises(ValueError, match="must be a list of 3"):
        cluster3.run(echo.scale(xs[:2], factor=[1, 2]))


def test_rank_zero_runs_only_on_first_rank(cluster3, groups):
    tp = groups[1]
    assert cluster3.run(tp.count_zero()) == 1  # the group's first rank is global rank 1
    assert cluster3.run(tp.zero_calls_seen()) == [1, 0]


@pytest.mark.both_stacks
def test_collective_inside_a_group(cluster3, groups):
    echo, tp, _ = groups
    assert cluster3.run(echo.all_reduce(2.0)) == [6.0] * 3
    assert cluster3.run(tp.all_reduce(1.5)) == [3.0] * 2


def test_dp_compute_through_transfer_queue(cluster3, groups):
    echo, tp, _ = groups

    async def go():
        tq = cluster3.tq_client()
        await tq.create_partition("dp")
        meta = await tq.put({"x": torch.arange(7)}, "dp")
        out_echo = await echo.double(meta, offset=1)  # 3 shards of 1 rank: split 3/2/2
        out_tp = await tp.double(meta, out="z")  # 1 shard of 2 ranks: leader fetches, broadcasts
        y = await tq.get_data(out_echo, ["y", "y_rank"])
        z = await tq.get_data(out_tp)
        await tq.close()
        return out_echo, out_tp, y, z
    out_echo, out_tp, y, z = cluster3.run(go())
    assert out_echo.rows == out_tp.rows and len(out_echo) == 7
    assert out_echo.columns == ["y", "y_rank"] and out_tp.columns == ["z", "z_rank"]
    assert y["y"].tolist() == [2 * i + 1 for i in range(7)]
    assert y["y_rank"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert z["z"].tolist() == [2 * i for i in range(7)] and z["z_rank"].tolist() == [1] * 7  # leader wrote
    # both ranks of the tp shard saw the whole batch: rank 2 got it by broadcast, not from the TQ
    assert cluster3.run(tp.seen()) == [list(range(7))] * 2


def test_disaggregated_groups_overlap(cluster3, groups, tmp_path):
    """A call on gen (rank 0) and one on tp (ranks 1-2) meet at a barrier of all three ranks:
    they can only if both run at the same time."""
    _, tp, gen = groups  # gen on rank 0, tp on ranks 1-2: apart

    async def go():
        return await asyncio.gather(gen.meet(str(tmp_path), [0, 1, 2], MEET_S),
                                    tp.meet(str(tmp_path), [0, 1, 2], MEET_S))
    a, b = cluster3.run(go(), timeout=3 * MEET_S)
    assert (a, b) == ([True], [True, True]), "the calls on disjoint ranks did not run at the same time"


def test_remote_exception_names_rank_role_method(cluster3, groups):
    with pytest.raises(WorkerError) as ei:
        cluster3.run(groups[1].fail("boom"))
    msg = str(ei.value)
    assert "tp.fail failed on rank 1" in msg and "ValueError: worker failed on purpose: boom" in msg
    assert "_deep_failure" in msg  # the remote traceback travelled
    assert ei.value.rank == 1 and ei.value.role == "tp" and ei.value.method == "tp.fail"
    assert cluster3.run(groups[1].whoami())  # the group still works after a method raised


def test_call_timeout(cluster3, groups):
    gen = groups[2]
    # Each call would return without error if the driver waited for its end: the raise is the
    # timeout firing first.
    with pytest.raises(WorkerCallTimeout, match=r"gen.slow_with_short_timeout on rank 0 .*within 0.5s"):
        cluster3.run(gen.slow_with_short_timeout(1.5))  # the method's own timeout
    with pytest.raises(WorkerCallTimeout, match=r"gen.sleep on rank 0 .*within 0.3s"):
        cluster3.run(gen.sleep(1.0, _timeout=0.3))  # a per-call override
    assert cluster3.run(gen.whoami())[0]["rank"] == 0  # later calls queue behind, then run


def test_unknown_method_and_bad_argument(cluster3, groups):
    with pytest.raises(AttributeError, match="no method 'nope'"):
        _ = groups[0].nope
    with pytest.raises(TypeError, match="cannot be sent"):
        cluster3.run(groups[0].whoami(x=object()))


def test_colocated_roles_take_turns(cluster3):
    d = cluster3.driver  # colocated placement: both roles on every rank

    async def go():
        actor = await d.create_group(W.RoleA, "actor")
        rollout = await d.create_group(W.RoleB, "rollout")
        assert actor.ranks == rollout.ranks == [0, 1, 2]
        await actor.work()
        await rollout.work()
        return await actor.work(), await rollout.work()
    a, r = cluster3.run(go())
    assert [p for p, _ in a] == [p for p, _ in r]  # same processes
    for _, events in r:
        assert events == ["onload:actor", "work:actor", "offload:actor", "onload:rollout", "work:rollout",
                          "offload:rollout", "onload:actor", "work:actor", "offload:actor", "onload:rollout",
                          "work:rollout"]


def test_role_without_device_state_runs_beside_the_loaded_one(cluster3):
    d = cluster3.driver

    async def go():
        heavy = await d.create_group(W.RoleWithEvents, "heavy")
        free = await d.create_group(W.DevicelessRole, "free")
        await heavy.clear_events()  # heavy is loaded now
        await free.work()
        return await heavy.work()
    for _, events in cluster3.run(go()):
        assert events == ["work:free", "work:heavy"]  # nothing offloaded or onloaded


def test_failed_onload_leaves_no_role_loaded(cluster3):
    """heavy was offloaded for fragile, whose onload failed: heavy's next call must onload it
    again, not run on state that was moved away."""
    d = cluster3.driver

    async def go():
        heavy = await d.create_group(W.RoleWithEvents, "heavy2")
        fragile = await d.create_group(W.FragileRole, "fragile")
        await heavy.clear_events()
        with pytest.raises(WorkerError, match="onload failed on purpose"):
            await fragile.work()
        return await heavy.work()
    for _, events in cluster3.run(go()):
        assert events == ["offload:heavy2", "onload:fragile", "onload:heavy2", "work:heavy2"]


@pytest.mark.both_stacks
def test_concurrent_collectives_of_groups_sharing_ranks(cluster3, groups):
    """echo (ranks 0-2) and tp (ranks 1-2) share ranks 1 and 2: their calls must reach both
    ranks in the same order, or the all_reduces would wait on each other (deadlock)."""
    echo, tp, _ = groups

    async def go():
        calls = []
        for i in range(6):
            calls += [echo.all_reduce(float(i), _timeout=10), tp.all_reduce(float(i), _timeout=10)]
        return await asyncio.gather(*calls)
    out = cluster3.run(go())
    assert out == [v for i in range(6) for v in ([3.0 * i] * 3, [2.0 * i] * 2)]


def test_spin_before_sleeping_is_bounded(cluster3, groups):
    """After short calls the driver may poll for a reply (up to DriverConfig.spin_us) before
    sleeping in the event loop; a long call costs at most that much driver CPU, and turns
    spinning off for its method."""
    gen = groups[2]

    async def go():
        for _ in range(5):
            await gen.sleep(0.0)
        cpu0 = time.thread_time()
        out = await gen.sleep(0.3)
        return out, time.thread_time() - cpu0, gen._spin["sleep"].budget()
    out, cpu, budget_after = cluster3.run(go())
    assert len(out) == 1
    # CPU time of the driver's thread, which load does not stretch: it slept through the call
    # (at most one 200 us spin), far from the 0.3 s it would burn spinning all along.
    assert cpu < 0.05
    assert budget_after == 0.0  # the policy saw a long call: spinning is off for this method


def test_driver_reaches_ranks_on_this_host_over_ipc(cluster3, groups):
    # Every rank runs on this host: the driver's call connections use their Unix sockets.
    assert all(ep.address.startswith("ipc://") for ep in cluster3.driver.ranks), \
        [ep.address for ep in cluster3.driver.ranks]
    assert cluster3.run(groups[0].whoami())


def test_a_storm_of_mixed_calls_gets_every_answer_right(cluster3, groups):
    """Waves of concurrent calls on the three groups (which share ranks), each at random an
    answer, a remote error or a timeout: every call gets its own result or its own error (a
    late reply of a timed-out call answers nothing else), nothing stays in flight, and every
    group still works afterwards."""
    rng = random.Random(11)
    seen = collections.Counter()

    async def one(i: int) -> None:
        wg = rng.choice(groups)
        kind = rng.choices(["ok", "fail", "timeout"], [6, 2, 1])[0]
        seen[kind] += 1
        if kind == "ok":
            out = await wg.whoami(x=i)
            assert [w["x"] for w in out] == [i] * len(wg.ranks) and [w["rank"] for w in out] == wg.ranks
            assert {w["role"] for w in out} == {wg.role}
        elif kind == "fail":
            with pytest.raises(WorkerError, match=rf"{wg.role}\.fail failed on rank {wg.ranks[0]}\b.*boom {i}\b"):
                await wg.fail(f"boom {i}")
        else:
            with pytest.raises(WorkerCallTimeout, match=rf"{wg.role}\.sleep on rank"):
                await wg.sleep(0.2, _timeout=0.05)

    async def storm() -> list:
        for wave in range(6):
            await asyncio.gather(*(one(100 * wave + i) for i in range(12)))
        # A rank serves one call at a time, in order, and replies in that order: once a call
        # to every rank answers, the timed-out sleeps before it have ended and replied (late).
        await groups[0].whoami()
        return cluster3.driver.in_flight()

    assert cluster3.run(storm(), timeout=120) == []
    assert seen["ok"] and seen["fail"] and seen["timeout"], seen
    for ep in cluster3.driver.ranks:
        assert not ep._rpc._pending, f"rank {ep.rank}: replies still awaited {list(ep._rpc._pending)}"
    for wg in groups:
        assert [w["x"] for w in cluster3.run(wg.whoami(x="after"))] == ["after"] * len(wg.ranks)


def test_concurrent_methods_are_served_while_a_call_runs(cluster3, groups, tmp_path):
    """A method registered concurrent=True answers while the rank runs a long call; its errors
    come back like any call's; the running call finishes undisturbed. The long call runs until
    the test releases it, after the concurrent answers came back."""
    echo = groups[0]

    async def go():
        holding = asyncio.ensure_future(echo.hold(str(tmp_path), MEET_S))
        for rank in echo.ranks:
            assert await asyncio.to_thread(_wait_for_file, tmp_path / f"started-{rank}"), f"rank {rank}"
        peeks = await echo.peek()
        with pytest.raises(WorkerError, match="ValueError: nope"):
            await echo.fail_beside("nope")
        assert not holding.done()
        (tmp_path / "release").touch()
        return peeks, await holding
    peeks, spans = cluster3.run(go(), timeout=3 * MEET_S)
    for (start, end), seen in zip(spans, peeks):
        assert start < seen < end  # answered while that rank was in its call
    with pytest.raises(ValueError, match="cannot use DP_COMPUTE"):
        from asyncflow.single_controller import register
        register("dp_compute", concurrent=True)


def test_create_groups_makes_many_with_one_call_per_rank(cluster3):
    """create_groups: every group of the list, in order, each on its own ranks; a group that
    fails to start names its rank and role, and a role given twice is refused before any call."""
    from asyncflow.single_controller import GroupSpec
    d = cluster3.driver
    made = cluster3.run(d.create_groups([GroupSpec(W.EchoWorker, f"many{k}", [k], None, {"tag": f"t{k}"})
                                         for k in range(3)] + [GroupSpec(W.EchoWorker, "many-all")]))
    assert [g.role for g in made] == ["many0", "many1", "many2", "many-all"]
    for k in range(3):
        (who,) = cluster3.run(made[k].whoami())
        assert (who["rank"], who["tag"], who["role"]) == (k, f"t{k}", f"many{k}")
    assert [w["rank"] for w in cluster3.run(made[3].whoami())] == [0, 1, 2]
    with pytest.raises(WorkerError, match=r"rank 1: creating group 'bad-init'.*unexpected keyword argument"):
        cluster3.run(d.create_groups([GroupSpec(W.EchoWorker, "fine-before", [1]),
                                      GroupSpec(W.EchoWorker, "bad-init", [1], None, {"nope": 1})]))
    assert cluster3.run(d.create_groups([])) == []
    with pytest.raises(ValueError, match="role twice"):
        cluster3.run(d.create_groups([GroupSpec(W.EchoWorker, "twice", [0]), GroupSpec(W.EchoWorker, "twice", [1])]))
