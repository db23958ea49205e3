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
