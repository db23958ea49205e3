"""Worker classes and driver mains used by the single-controller tests. They live in a
module of their own so that worker processes (spawned) import them by name."""
from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist

from asyncflow.single_controller import Dispatch, Worker, register

EVENTS: list[str] = []  # per process: colocation hooks and calls, in order


def _mark(folder: str, name: str) -> None:
    open(os.path.join(folder, name), "w").close()


def _wait_for_marks(folder: str, names: list[str], timeout_s: float) -> bool:
    """True once every mark of ``names`` exists in ``folder``; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(folder, n)) for n in names):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class EchoWorker(Worker):
    def __init__(self, tag: str = ""):
        self.tag = tag
        self.zero_calls = 0
        self.last_seen: list[int] = []

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, x=None) -> dict:
        return {"rank": self.rank, "group_rank": self.group_rank, "dp_rank": self.dp_rank, "x": x,
                "pid": os.getpid(), "tag": self.tag, "role": self.role}

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @register(Dispatch.RANK_ZERO)
    def count_zero(self) -> int:
        self.zero_calls += 1
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def zero_calls_seen(self) -> int:
        return self.zero_calls

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, group=self.process_group)
        return float(t[0])

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> list[float]:
        start = time.time()
        time.sleep(seconds)
        return [start, time.time()]

    @register(Dispatch.ONE_TO_ALL)
    def meet(self, folder: str, ranks: list[int], timeout_s: float) -> bool:
        """A barrier across groups: mark this rank's arrival in ``folder``, then wait until
        every rank of ``ranks`` has arrived (True) or ``timeout_s`` has passed (False). Only
        calls running at the same time can all meet."""
        _mark(folder, f"arrived-{self.rank}")
        return _wait_for_marks(folder, [f"arrived-{r}" for r in ranks], timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def hold(self, folder: str, timeout_s: float) -> list[float]:
        """A call that runs until the test releases it: mark ``started-<rank>`` in ``folder``,
        wait for a ``release`` mark; [start, end] of the call (wall clock of this host)."""
        start = time.time()
        _mark(folder, f"started-{self.rank}")
        if not _wait_for_marks(folder, ["release"], timeout_s):
            raise TimeoutError(f"rank {self.rank}: no release mark in {folder} within {timeout_s}s")
        return [start, time.time()]

    @register(Dispatch.ONE_TO_ALL)
    def fail(self, msg: str) -> None:
        _deep_failure(msg)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def peek(self) -> float:
        """Served beside a running call (a service's control method)."""
        return time.time()

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def fail_beside(self, msg: str) -> None:
        raise ValueError(msg)

    @register(Dispatch.ONE_TO_ALL, timeout_s=0.5)
    def slow_with_short_timeout(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.DP_COMPUTE)
    def double(self, data, offset: int = 0, out: str = "y") -> dict:
        x = data["x"]
        self.last_seen = x.tolist()
        return {out: x * 2 + offset, f"{out}_rank": torch.full_like(x, self.rank)}

    @register(Dispatch.ONE_TO_ALL)
    def seen(self) -> list[int]:
        return self.last_seen


class HeapWorker(Worker):
    """Builds objects and reports what the cyclic collector of its process still walks."""

    def __init__(self, n: int = 0):
        self.kept = [[i] for i in range(n)]  # objects made while the group is created

    @register(Dispatch.ONE_TO_ALL)
    def build(self, n: int) -> None:
        self.kept += [[i] for i in range(n)]

    @register(Dispatch.ONE_TO_ALL)
    def heap(self) -> dict:
        """The process's frozen count and how many of the kept objects a collection would walk."""
        kept = {id(x) for x in self.kept}
        return {"frozen": gc.get_freeze_count(), "kept": len(kept),
                "walked": sum(id(o) in kept for o in gc.get_objects())}


def _deep_failure(msg: str) -> None:
    raise ValueError(f"worker failed on purpose: {msg}")


class RoleA(Worker):
    def onload(self) -> None:
        EVENTS.append(f"onload:{self.role}")

    def offload(self) -> None:
        EVENTS.append(f"offload:{self.role}")

    @register(Dispatch.ONE_TO_ALL)
    def work(self) -> list:
        EVENTS.append(f"work:{self.role}")
        return [os.getpid(), list(EVENTS)]


class RoleB(RoleA):
    pass


class RoleWithEvents(RoleA):
    @register(Dispatch.ONE_TO_ALL)
    def clear_events(self) -> None:
        EVENTS.clear()


class DevicelessRole(RoleA):
    needs_device = False  # runs beside the loaded role: its hooks must never be called


class FragileRole(RoleA):
    """Its first onload on each rank fails (e.g. out of memory moving state back)."""
    failures_left = 1

    def onload(self) -> None:
        super().onload()
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("onload failed on purpose")


# ---- driver mains for the launch tests -------------------------------------------------

async def launch_demo_main(driver) -> None:
    """Self-launch check: groups on every rank, a collective, a DP_COMPUTE through the TQ."""
    from asyncflow.transfer_queue import AsyncTransferQueueClient

    wg = await driver.create_group(EchoWorker, "echo", tag="launched")
    who = await wg.whoami()
    assert [w["rank"] for w in who] == list(range(driver.world_size)), who
    assert len({w["pid"] for w in who}) == driver.world_size, who
    # Rank 0 serves on a thread of this process: no spinning for its groups (the GIL); the
    # other ranks' group may spin.
    assert driver.ranks[0].in_process and not driver.ranks[1].in_process
    assert wg._spin_s == 0.0
    other = await driver.create_group(EchoWorker, "others", ranks=list(range(1, driver.world_size)))
    assert other._spin_s > 0 and len(await other.whoami()) == driver.world_size - 1
    total = await wg.all_reduce(1.0)
    assert total == [float(driver.world_size)] * driver.world_size, total
    tq = AsyncTransferQueueClient(driver.transfer_queue_address)
    await tq.create_partition("p0")
    meta = await tq.put({"x": torch.arange(6)}, "p0")
    out = await wg.double(meta)
    got = await tq.get_data(out, ["y"])
    assert got["y"].tolist() == [0, 2, 4, 6, 8, 10], got
    await tq.close()
    print("LAUNCH-DEMO-OK", driver.world_size, driver.addresses, driver.transfer_queue_address, flush=True)


async def launch_failing_main(driver) -> None:
    wg = await driver.create_group(EchoWorker, "echo")
    await wg.fail("from the launch test")


async def launch_sleeping_main(driver) -> None:
    """For a kill test: rank 1 alone runs ``train.sleep(60)``; its pid is printed first."""
    train = await driver.create_group(EchoWorker, "train", ranks=[1])
    [who] = await train.whoami()
    print("RANK1-PID", who["pid"], flush=True)
    await train.sleep(60.0)
