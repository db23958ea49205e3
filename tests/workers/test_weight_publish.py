"""publish_and_swap (weight_sync/publish.py), the one path a version takes from the driver:
every instance receiving first, then the publish, then the swaps in waves; what a failed swap
stops; and the phase sync (training/phases.py) swapping one instance at a time."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncflow.training.phases import sync_weights
from asyncflow.weight_sync.publish import publish_and_swap


class Group:
    """A worker group that logs its weight calls; a swap takes a few loop turns, so that swaps
    of one wave overlap and a wave that waits for another shows it."""

    def __init__(self, name: str, log: list, fail_swap: bool = False):
        self.role, self.ranks, self.log, self.fail_swap = name, [0], log, fail_swap

    async def receive_weights(self, v):
        self.log.append(("receive", self.role, v))

    async def publish_weights(self, v):
        self.log.append(("publish", self.role, v))
        return {"bytes": 1}

    async def swap_weights(self, v):
        self.log.append(("swap_start", self.role, v))
        for _ in range(3):
            await asyncio.sleep(0)
        if self.fail_swap:
            raise RuntimeError(f"{self.role} refused version {v}")
        self.log.append(("swap_end", self.role, v))
        return {"version": v, "pause_s": 0.0}


def _run(coro):
    return asyncio.run(coro)


def test_every_instance_receives_before_the_publish_and_swaps_go_in_waves():
    log = []
    policy, insts = Group("actor", log), [Group(f"r{k}", log) for k in range(5)]

    async def published():
        log.append(("published",))

    async def swapped(members):
        log.append(("swapped", members))

    _run(publish_and_swap(policy, insts, 3, wave=2, on_published=published, on_swapped=swapped))
    assert log[:5] == [("receive", f"r{k}", 3) for k in range(5)]
    assert log[5:7] == [("publish", "actor", 3), ("published",)]
    assert log[7:] == [("swap_start", "r0", 3), ("swap_start", "r1", 3), ("swap_end", "r0", 3), ("swap_end", "r1", 3),
                       ("swapped", [0, 1]),
                       ("swap_start", "r2", 3), ("swap_start", "r3", 3), ("swap_end", "r2", 3), ("swap_end", "r3", 3),
                       ("swapped", [2, 3]),
                       ("swap_start", "r4", 3), ("swap_end", "r4", 3), ("swapped", [4])]


def test_timed_wraps_the_publish_and_each_swap_with_its_group():
    log, seen = [], []
    policy, insts = Group("actor", log), [Group(f"r{k}", log) for k in range(2)]

    async def timed(group, call):
        seen.append(group.role)
        return await call

    _run(publish_and_swap(policy, insts, 1, wave=2, timed=timed))
    assert seen == ["actor", "r0", "r1"]


def test_a_failed_swap_is_raised_once_its_wave_ended_and_later_waves_do_not_start():
    log, swapped = [], []
    insts = [Group("r0", log), Group("r1", log, fail_swap=True), Group("r2", log), Group("r3", log)]

    async def on_swapped(members):
        swapped.append(members)

    with pytest.raises(RuntimeError, match="r1 refused version 2"):
        _run(publish_and_swap(Group("actor", log), insts, 2, wave=3, on_swapped=on_swapped))
    assert ("swap_end", "r2", 2) in log  # the wave's other swaps ended first
    assert not any(e[1] == "r3" and e[0].startswith("swap") for e in log)
    assert swapped == []


def test_a_wave_of_no_instance_is_refused():
    with pytest.raises(ValueError, match="wave must be at least 1"):
        _run(publish_and_swap(Group("actor", []), [], 1, wave=0))


def test_the_phase_sync_swaps_one_instance_at_a_time():
    log = []
    roles = SimpleNamespace(policy=Group("actor", log), instances=[Group(f"r{k}", log) for k in range(3)])
    _run(sync_weights(roles, 0))
    swaps = [e for e in log if e[0].startswith("swap")]
    assert swaps == [(what, f"r{k}", 0) for k in range(3) for what in ("swap_start", "swap_end")]
    assert log.index(("publish", "actor", 0)) == 3  # after the three receives, before any swap


class Taker(Group):
    """An instance whose worker has take_weights: receive and swap in one call, which waits
    for the publish (as a receive over the wire does)."""

    methods = {"take_weights": None, "receive_weights": None, "swap_weights": None}

    def __init__(self, name: str, log: list, published: asyncio.Event, fail: bool = False):
        super().__init__(name, log)
        self.published, self.fail = published, fail

    async def take_weights(self, v):
        self.log.append(("take_start", self.role, v))
        await self.published.wait()
        if self.fail:
            raise RuntimeError(f"{self.role} could not load version {v}")
        self.log.append(("take_end", self.role, v))
        return {"version": v, "pause_s": 0.0}


class Publisher(Group):
    def __init__(self, log: list, published: asyncio.Event, fail: bool = False):
        super().__init__("actor", log)
        self.published, self.fail = published, fail

    async def publish_weights(self, v):
        await asyncio.sleep(0)  # the takers' calls are out first
        if self.fail:
            raise RuntimeError("the actor could not send")
        out = await super().publish_weights(v)
        self.published.set()
        return out


def test_the_first_waves_instances_that_take_weights_get_one_call_beside_the_publish():
    log, seen = [], []

    async def main():
        published = asyncio.Event()
        insts = [Taker("r0", log, published), Group("r1", log), Taker("r2", log, published)]

        async def timed(group, call):
            seen.append(group.role)
            return await call

        async def on_published():
            log.append(("published",))

        async def on_swapped(members):
            log.append(("swapped", members))
        await publish_and_swap(Publisher(log, published), insts, 4, wave=2, timed=timed,
                               on_published=on_published, on_swapped=on_swapped)
    _run(main())
    # r0 (first wave, a taker): one call; r1 (first wave, no take_weights) and r2 (second wave):
    # a receive before the publish and a swap after it
    assert log[:4] == [("receive", "r1", 4), ("receive", "r2", 4), ("take_start", "r0", 4), ("publish", "actor", 4)]
    assert log[4:6] == [("published",), ("take_end", "r0", 4)]  # published once sent, not once swapped
    assert log[6:] == [("swap_start", "r1", 4), ("swap_end", "r1", 4), ("swapped", [0, 1]),
                       ("swap_start", "r2", 4), ("swap_end", "r2", 4), ("swapped", [2])]
    assert not any(e[0] in ("receive", "swap_start") and e[1] == "r0" for e in log)
    assert sorted(seen) == ["actor", "r0", "r1", "r2"]  # every call timed under its group


def test_a_failed_publish_ends_the_takers_calls_and_a_failed_take_is_raised_with_its_wave():
    log = []

    async def failed_publish():
        published = asyncio.Event()
        await publish_and_swap(Publisher(log, published, fail=True), [Taker("r0", log, published)], 1)

    with pytest.raises(RuntimeError, match="the actor could not send"):
        _run(failed_publish())
    assert log == [("take_start", "r0", 1)]  # its wait was cancelled, nothing swapped

    log.clear()
    swapped = []

    async def failed_take():
        published = asyncio.Event()
        insts = [Taker("r0", log, published, fail=True), Group("r1", log), Group("r2", log)]

        async def on_swapped(members):
            swapped.append(members)
        await publish_and_swap(Publisher(log, published), insts, 2, wave=2, on_swapped=on_swapped)

    with pytest.raises(RuntimeError, match="r0 could not load version 2"):
        _run(failed_take())
    assert ("swap_end", "r1", 2) in log  # the wave's other swap ended first
    assert not any(e[0].startswith("swap") and e[1] == "r2" for e in log) and swapped == []
