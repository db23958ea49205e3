"""A stateless role beside replaceable rollout instances (training/replicas.py): its rows are
split over the ranks in service; a lost rank's share is computed again on the others, except
the rows it had written; no member in service: the call waits for one to come back."""
from __future__ import annotations

import asyncio

import pytest

from asyncflow.single_controller.dispatch import MethodSpec
from asyncflow.single_controller.errors import WorkerDiedError
from asyncflow.training.replicas import ReplicatedRole
from asyncflow.transfer_queue.meta import BatchMeta

IO = {"inputs": ["response_ids"], "outputs": ["scores"], "options": {}}


class _Rank:
    def __init__(self):
        self.dead = asyncio.get_running_loop().create_future()

    def declare_dead(self):
        self.dead.set_exception(WorkerDiedError("lost"))
        self.dead.exception()  # retrieved: no "never retrieved" warning


class _Driver:
    def __init__(self, n: int):
        self.ranks = [_Rank() for _ in range(n)]


class _Member:
    """One rank's reward group: records the rows it was given; ``dies_with`` rows written first."""

    cls = object
    methods = {"compute": MethodSpec("dp_compute"), "stats": MethodSpec("one_to_all")}

    def __init__(self, driver: _Driver, rank: int, written: set[int]):
        self.driver, self.ranks, self.written = driver, [rank], written
        self.got: list[list[int]] = []
        self.dies_writing: int | None = None  # rows of its share it writes before its process dies

    async def call(self, method: str, *args, **kwargs):
        ep = self.driver.ranks[self.ranks[0]]
        if ep.dead.done():
            raise WorkerDiedError(f"rank {self.ranks[0]} is dead")
        if method == "stats":
            return [{"rank": self.ranks[0]}]
        meta = args[0]
        self.got.append(list(meta.rows))
        if self.dies_writing is not None:
            self.written.update(meta.rows[:self.dies_writing])
            ep.declare_dead()
            raise WorkerDiedError(f"{self.ranks[0]}.compute cannot finish")
        self.written.update(meta.rows)
        return meta


class _TQ:
    """get_meta of the rows that have the column, each returned once to the task."""

    def __init__(self, written: set[int]):
        self.written, self.given = written, set()

    async def get_meta(self, columns, batch_size, task, partition, *, allow_partial, timeout):
        assert columns == ["scores"] and allow_partial and timeout == 0.0
        rows = sorted(self.written - self.given)[:batch_size]
        self.given.update(rows)
        return BatchMeta(partition, rows, list(columns))


def _role(n: int = 2):
    driver, written = _Driver(n + 1), set()
    members = [_Member(driver, r, written) for r in range(1, n + 1)]
    role = ReplicatedRole(driver, "reward", members, wait_s=5.0)
    settled: list[int] = []

    async def settle(rank):
        settled.append(rank)
    role.attach(_TQ(written), settle)
    return role, driver, members, written, settled


def test_rows_are_split_over_the_members_in_service():
    async def main():
        role, driver, (a, b), written, _ = _role()
        out = await role.compute(BatchMeta("step0", list(range(8)), ["response_ids"]), IO)
        assert a.got == [[0, 1, 2, 3]] and b.got == [[4, 5, 6, 7]] and out.rows == list(range(8))
        assert role.ranks == [1, 2] and role.role == "reward"
        driver.ranks[2].declare_dead()  # out of service: the next call goes to rank 1 alone
        out = await role.compute(BatchMeta("step1", [8, 9], ["response_ids"]), IO)
        assert a.got[-1] == [8, 9] and len(b.got) == 1 and out.rows == [8, 9]
        assert await role.stats() == [{"rank": 1}]  # a lost member's statistics are left out
    asyncio.run(main())


def test_a_lost_members_unwritten_rows_are_computed_again_and_its_written_rows_stay():
    async def main():
        role, driver, (a, b), written, settled = _role()
        b.dies_writing = 1  # row 4 written, rows 5..7 not
        out = await role.compute(BatchMeta("step0", list(range(8)), ["response_ids"]), IO)
        assert settled == [2]  # the lost process is gone before its rows are read
        assert b.got == [[4, 5, 6, 7]] and a.got == [[0, 1, 2, 3], [5, 6, 7]]
        assert sorted(out.rows) == list(range(8)) and len(out.rows) == 8  # every row once
        assert role.recomputed_rows == 3 and written == set(range(8))
    asyncio.run(main())


def test_with_no_member_in_service_a_call_waits_for_one_to_come_back():
    async def main():
        role, driver, (a,), written, _ = _role(n=1)
        a.dies_writing = 0

        async def back():  # the driver attaches the rank's new process (Driver.replace_rank)
            while not driver.ranks[1].dead.done():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            a.dies_writing = None
            driver.ranks[1] = _Rank()
        task = asyncio.create_task(back())
        out = await role.compute(BatchMeta("step0", [0, 1, 2], ["response_ids"]), IO)
        await task
        assert a.got == [[0, 1, 2], [0, 1, 2]] and out.rows == [0, 1, 2] and role.recomputed_rows == 3
    asyncio.run(main())


def test_a_failure_that_is_not_a_lost_rank_is_raised():
    async def main():
        role, driver, (a, b), _, _ = _role()

        async def fails(method, *args, **kwargs):
            raise WorkerDiedError("rank 2: some other death, not a tolerated loss")
        b.call = fails
        with pytest.raises(WorkerDiedError, match="some other death"):
            await role.compute(BatchMeta("step0", list(range(4)), ["response_ids"]), IO)
    asyncio.run(main())


def test_members_must_each_be_one_rank():
    class _Wide(_Member):
        def __init__(self):
            self.ranks = [1, 2]
    with pytest.raises(ValueError, match="one group per rank"):
        ReplicatedRole(None, "reward", [_Wide()], wait_s=1.0)
