"""The driver's side of the control plane: one connection per worker rank, heartbeats,
and the creation of worker groups.

Each rank is reached through a ``ranks.RankEndpoint`` (calls, plus a second client used
only for heartbeats, so a ping never queues behind a large message). A rank that misses
``heartbeat_misses`` pings in a row is declared dead: every call in flight to it fails at
once with WorkerDiedError, and so does the run, unless the rank was declared replaceable
(``tolerate_loss``: a rollout instance's rank): then its loss is reported to a callback, and
``replace_rank`` later attaches the rank's new process and builds its groups on it again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq.asyncio

from ..rpc.errors import RpcTimeout
from .errors import WorkerDiedError
from .layout import GroupLayout
from .placement import RolePlacement
from .ranks import RankCall, RankEndpoint
from .runtime import class_path
from .wire import to_wire
from .worker import Worker
from .worker_group import WorkerGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DriverConfig:
    call_timeout_s: float = 300.0  # default timeout of a worker method call
    create_timeout_s: float = 300.0  # building a worker group (process groups + __init__)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    heartbeat_misses: int = 2  # dead after this many missed pings in a row (~5 s by default)
    attach_timeout_s: float = 60.0  # every worker must answer a first ping within this
    # After sending a group call, poll for the replies up to this long before sleeping in the
    # event loop, while that method's last call came back within it (rpc.spin.SpinPolicy).
    # Saves a wake-up per call on idle vCPUs; 0 turns it off.
    spin_us: float = 200.0


@dataclass
class GroupSpec:
    """One group for ``Driver.create_groups``: as ``create_group``'s arguments."""

    cls: type[Worker]
    role: str
    ranks: list[int] | None = None
    dp_size: int | None = None
    init_kwargs: dict[str, Any] = field(default_factory=dict)


class Driver:
    """Talks to every worker rank; makes worker groups; notices dead workers.

    ``async with Driver(addresses, ...) as driver:`` or ``await driver.start()`` /
    ``await driver.shutdown()``. Use ``await driver.run(main(driver))`` to run the
    algorithm so that a dead worker stops it even when no call is in flight.
    """

    def __init__(self, addresses: list[str], *, placement: RolePlacement | None = None,
                 config: DriverConfig | None = None, transfer_queue_address: str | None = None):
        self.addresses = list(addresses)
        self.placement = placement or RolePlacement()
        self.config = config or DriverConfig()
        self.transfer_queue_address = transfer_queue_address
        self.ranks: list[RankEndpoint] = []
        self.failed: asyncio.Future[Any] | None = None
        self._monitors: list[asyncio.Task[Any]] = []
        self._heartbeats_stopped = False
        self._create_lock: asyncio.Lock | None = None
        self._ctx = zmq.asyncio.Context()
        # Ranks whose loss does not stop the run: rank -> called with its WorkerDiedError and lost pid.
        self._on_lost: dict[int, Callable[[int, WorkerDiedError, int | None], None]] = {}
        self._created: dict[str, dict[str, Any]] = {}  # role -> how its group was created (for replace_rank)
        self.store: Any = None  # the launcher's store, where it runs one (restart requests go there)

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    async def start(self) -> Driver:
        loop = asyncio.get_running_loop()
        self.failed = loop.create_future()
        self.failed.add_done_callback(lambda f: f.exception())
        self._create_lock = asyncio.Lock()
        self.ranks = [RankEndpoint(r, a, self._ctx) for r, a in enumerate(self.addresses)]
        await self._attach()
        if self.transfer_queue_address:
            await self.set_transfer_queue(self.transfer_queue_address)
        self._monitors = [loop.create_task(self._monitor(ep), name=f"heartbeat-{ep.rank}") for ep in self.ranks]
        return self

    def _failure(self) -> asyncio.Future[Any]:
        if self.failed is None:
            raise RuntimeError("the Driver is not started: await driver.start() (or use `async with Driver(...)`)")
        return self.failed

    def _creation_lock(self) -> asyncio.Lock:
        if self._create_lock is None:
            raise RuntimeError("the Driver is not started: await driver.start() (or use `async with Driver(...)`)")
        return self._create_lock

    async def _attach(self) -> None:
        """First contact: every worker must answer a ping before the attach timeout."""
        deadline = time.monotonic() + self.config.attach_timeout_s

        async def first(ep: RankEndpoint) -> None:
            while True:
                try:
                    ep.info = await ep.ping(min(2.0, max(0.1, deadline - time.monotonic())))
                    return
                except RpcTimeout:
                    if time.monotonic() > deadline:
                        raise WorkerDiedError(f"{ep.where()} did not answer within "
                                              f"{self.config.attach_timeout_s:.0f}s of attach",
                                              rank=ep.rank) from None
        await asyncio.gather(*(first(ep) for ep in self.ranks))

    async def _monitor(self, ep: RankEndpoint) -> None:
        cfg = self.config
        misses, last_ok = 0, time.monotonic()
        while not self._heartbeats_stopped:  # a flag as well as cancel(): 3.11's wait_for can swallow a cancel
            try:
                await ep.ping(cfg.heartbeat_timeout_s)
                misses, last_ok = 0, time.monotonic()
                await asyncio.sleep(cfg.heartbeat_interval_s)
            except RpcTimeout:  # the timeout already spent the interval: ping again now
                misses += 1
                if misses >= cfg.heartbeat_misses:
                    # Name what it was running: the run's own error may come from a call to another rank.
                    busy = ep.in_flight()
                    doing = "; it was running " + RankCall.describe_all(busy) if busy else ""
                    err = WorkerDiedError(
                        f"worker {ep.where()} stopped answering heartbeats {time.monotonic() - last_ok:.1f}s "
                        f"ago: its process died or hangs{doing}", rank=ep.rank, role=",".join(ep.roles),
                        method=busy[0].what if busy else "")
                    ep.declare_dead(err)
                    on_lost = self._on_lost.get(ep.rank)
                    if on_lost is not None:  # replaceable: the run goes on without it
                        log.warning("%s", err)
                        on_lost(ep.rank, err, (ep.info or {}).get("pid"))
                        return
                    log.error("%s", err)
                    if not self._failure().done():
                        self._failure().set_exception(err)
                    return

    def in_flight(self) -> list[RankCall]:
        """Every call still waiting for its reply, by rank, oldest first."""
        return [c for ep in self.ranks for c in ep.in_flight()]

    def describe_in_flight(self) -> str:
        """The calls in flight, as ``rank 1 (role train) train.sleep, running 2.1 s; ...``:
        what a run stopped from outside (the launcher's SIGTERM) was waiting for."""
        return RankCall.describe_all(self.in_flight()) or "no call in flight"

    def check(self) -> None:
        """Raise the first fatal error (a dead worker), if any."""
        if self.failed is not None and self.failed.done():
            err = self.failed.exception()  # set only with set_exception
            if err is not None:
                raise err

    async def run(self, main: Awaitable[T]) -> T:
        """Await ``main``; if a worker dies first, cancel it and raise the WorkerDiedError."""
        task = asyncio.ensure_future(main)
        await asyncio.wait([task, self._failure()], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=5)
            self.check()
        return task.result()

    async def set_transfer_queue(self, address: str) -> None:
        self.transfer_queue_address = address
        await asyncio.gather(*(ep.request("set_transfer_queue", "set_transfer_queue", None, 30.0, control=True,
                                          address=address) for ep in self.ranks))

    async def create_group(self, cls: type[Worker], role: str, *, ranks: list[int] | None = None,
                           dp_size: int | None = None, **init_kwargs: Any) -> WorkerGroup:
        """Start a worker of ``cls`` as ``role`` on its ranks (from the placement unless given)."""
        return (await self.create_groups([GroupSpec(cls, role, ranks, dp_size, init_kwargs)]))[0]

    async def create_groups(self, specs: Sequence[GroupSpec]) -> list[WorkerGroup]:
        """Start several groups, in order, with one call per rank: with hundreds of rollout
        instances, a call to the whole world per instance made creation quadratic in ranks."""
        self.check()
        if not specs:
            return []
        made: list[tuple[GroupLayout, str, dict[str, Any], type]] = []
        for spec in specs:
            ranks = list(spec.ranks) if spec.ranks is not None else self.placement.ranks_for(spec.role, self.world_size)
            dp = spec.dp_size or self.placement.dp_size_for(spec.role, len(ranks))
            made.append((GroupLayout(spec.role, tuple(ranks), dp), class_path(spec.cls),
                         to_wire(dict(spec.init_kwargs)), spec.cls))
        roles = [m[0].role for m in made]
        if len(set(roles)) != len(roles):
            raise ValueError(f"create_groups got a role twice: {roles}")
        what = f"create_groups({', '.join(roles)})" if len(roles) > 1 else f"{roles[0]}.__init__"
        # new_group is collective over the whole world and must run in the same order on
        # every rank: one creation at a time, sent to every rank.
        async with self._creation_lock():
            await asyncio.gather(*(
                ep.request("create_groups", what, roles[0] if len(roles) == 1 else None, self.config.create_timeout_s,
                           groups=[{"layout": layout.to_wire(), "cls": path, "init_kwargs": kwargs,
                                    "member": ep.rank in layout.ranks} for layout, path, kwargs, _ in made])
                for ep in self.ranks))
        groups = []
        for layout, path, kwargs, cls in made:
            self._created[layout.role] = {"layout": layout.to_wire(), "cls": path, "init_kwargs": kwargs}
            for r in layout.ranks:
                self.ranks[r].roles.append(layout.role)
            groups.append(WorkerGroup(self, layout, cls))
        return groups

    async def make_group(self, ranks: list[int], backend: str = "gloo", timeout_s: float = 300.0) -> None:
        """A process group of these ranks, made on every rank in the same order (a collective over
        the world, like create_group); its members' workers get it from ``group_of(ranks)``."""
        self.check()
        async with self._creation_lock():
            await asyncio.gather(*(
                ep.request("make_group", f"make_group({sorted(ranks)})", None, self.config.create_timeout_s,
                           ranks=sorted(int(r) for r in ranks), backend=backend, timeout_s=timeout_s)
                for ep in self.ranks))

    async def freeze_heaps(self) -> list[int]:
        """Every live rank keeps what it has built so far (models, data, the run's state) out of
        later garbage collections: a full collection then walks only what the loop makes, not
        the whole heap (``alloc.refreeze_gc_heap``; a no-op in a process the launcher did not
        start). Before a long loop. Returns each live rank's count of frozen objects."""
        self.check()
        live = [ep for ep in self.ranks if not ep.dead.done()]
        replies = await asyncio.gather(*(ep.request("freeze_heap", "freeze_heap", None, self.config.create_timeout_s)
                                         for ep in live))
        return [int(r["frozen"]) for r in replies]

    # ---- replaceable ranks ------------------------------------------------------------------
    def tolerate_loss(self, ranks: Sequence[int],
                      on_lost: Callable[[int, WorkerDiedError, int | None], None]) -> None:
        """A rank of ``ranks`` that stops answering no longer stops the run: it is declared dead
        (its calls in flight fail with WorkerDiedError) and ``on_lost(rank, error, pid)`` is called
        (the pid of the process lost, where it said).
        Only for ranks whose groups are theirs alone (a rollout instance per rank): a group over
        several ranks would have a member gone from its collectives."""
        for r in ranks:
            shared = [role for role in self.ranks[r].roles
                      if len(self._created.get(role, {}).get("layout", {}).get("ranks", [r])) > 1]
            if shared:
                raise ValueError(f"rank {r} cannot be replaced: it is a member of the multi-rank groups {shared}")
            self._on_lost[int(r)] = on_lost

    async def replace_rank(self, rank: int, address: str, timeout_s: float) -> None:
        """Attach the new process of a lost replaceable ``rank`` (its worker address) and build
        the rank's groups on it again, as they were first created (a group of this rank alone
        needs no collective over the world, so no other rank takes part)."""
        old = self.ranks[rank]
        if not old.dead.done():
            raise RuntimeError(f"replace_rank({rank}): the rank is not declared dead")
        ep = RankEndpoint(rank, address, self._ctx)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ep.info = await ep.ping(min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except RpcTimeout:
                if time.monotonic() > deadline:
                    await ep.close()
                    raise WorkerDiedError(f"the new process of rank {rank} ({address}) did not answer within "
                                          f"{timeout_s:.0f}s", rank=rank) from None
        # watched from its first answer on: building its workers may take long (loading a model),
        # and it exits if the driver's pings stop meanwhile (RuntimeConfig.driver_timeout_s)
        self._monitors.append(asyncio.get_running_loop().create_task(self._monitor(ep), name=f"heartbeat-{rank}"))
        if self.transfer_queue_address:
            await ep.request("set_transfer_queue", "set_transfer_queue", None, 30.0, control=True,
                             address=self.transfer_queue_address)
        roles = list(old.roles)
        groups = [{**self._created[role], "member": True} for role in roles]
        if groups:
            await ep.request("create_groups", f"create_groups({', '.join(roles)}) on the new process", None,
                             self.config.create_timeout_s, groups=groups)
        ep.roles.extend(roles)
        self.ranks[rank] = ep  # worker groups look their ranks up here at every call
        await old.close()

    async def stop_heartbeats(self) -> None:
        """Stop pinging the workers (they exit after ``driver_timeout_s`` unless shut down)."""
        self._heartbeats_stopped = True
        for t in self._monitors:
            t.cancel()
        if self._monitors:
            await asyncio.wait(self._monitors, timeout=5)
        self._monitors = []

    async def shutdown(self) -> None:
        """Stop heartbeats, tell every live worker to stop serving, close connections."""
        await self.stop_heartbeats()
        live = [ep for ep in self.ranks if not ep.dead.done()]
        # After a failure, other workers may be deep in a long call: make them exit now,
        # except the worker living in this very process (rank 0 under the launcher).
        failed = self.failed is not None and self.failed.done()

        async def stop(ep: RankEndpoint) -> None:
            if failed and ep.info.get("pid") != os.getpid():
                await ep.request("exit_now", "exit_now", None, 3.0, control=True)
            else:
                await ep.request("shutdown", "shutdown", None, 3.0)
        await asyncio.gather(*(stop(ep) for ep in live), return_exceptions=True)
        for ep in self.ranks:
            await ep.close()
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> Driver:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()
