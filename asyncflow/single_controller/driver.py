"""The driver's side of the control plane: one connection per worker rank, heartbeats,
and the creation of worker groups.

Each rank is reached through a ``transport.RpcClient`` (calls multiplexed on one DEALER
socket) plus a second client used only for heartbeats, so a ping never queues behind a
large message. A rank that misses ``heartbeat_misses`` pings in a row is declared dead:
every call in flight to it fails at once with WorkerDiedError, and so does the run.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

import zmq.asyncio

from ..rpc.errors import RemoteError, RpcTimeout
from ..rpc.transport import RpcClient
from .errors import WorkerCallTimeout, WorkerDiedError, WorkerError
from .layout import GroupLayout
from .placement import PlacementConfig
from .runtime import calls_address, class_path, split_address
from .wire import from_wire, to_wire

if TYPE_CHECKING:  # a runtime import would be circular: worker_group imports this module
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
    # event loop, while that method's last call came back within it (transport.SpinPolicy).
    # Saves a wake-up per call on idle vCPUs; 0 turns it off.
    spin_us: float = 200.0


class _RankLost(Exception):
    """Set on the calls in flight to a rank declared dead; turned into WorkerDiedError."""

    def __init__(self, err: WorkerDiedError):
        super().__init__(str(err))
        self.err = err


def _failed(fut: asyncio.Future) -> bool:
    """A finished rank call that raises when its result is taken (any failure at all)."""
    if fut.cancelled() or fut.exception() is not None:
        return True
    msg = fut.result()
    if "e" in msg:
        return True
    r = msg.get("r")
    return isinstance(r, dict) and "err" in r


class RankCall:
    """One call in flight to one rank: its future holds the reply message."""

    __slots__ = ("ep", "client", "rid", "fut", "op", "what", "role", "timeout", "started")

    def __init__(self, ep: "RankEndpoint", client: RpcClient, rid: int, fut: asyncio.Future, op: str, what: str,
                 role: str | None, timeout: float):
        self.ep, self.client, self.rid, self.fut = ep, client, rid, fut
        self.op, self.what, self.role, self.timeout = op, what, role, timeout
        self.started = time.monotonic()  # for the report of a run stopped mid-call (Driver.describe_in_flight)

    def describe(self, now: float) -> str:
        """``rank 1 (role train) train.sleep, running 2.1 s``: one call in flight, for a report."""
        role = self.role or ",".join(self.ep.roles) or "no role yet"
        return f"rank {self.ep.rank} (role {role}) {self.what}, running {now - self.started:.1f} s"

    @staticmethod
    def describe_all(calls: list["RankCall"]) -> str:
        """Calls in flight, ``; ``-joined (empty for none)."""
        now = time.monotonic()
        return "; ".join(c.describe(now) for c in calls)

    def failed(self) -> bool:
        return _failed(self.fut)

    def cancel(self) -> None:
        self.client.forget(self.rid)
        self.fut.cancel()

    async def wait(self) -> Any:
        """The call's value, once its reply is in (or its error, raised)."""
        try:
            await self.fut
        except asyncio.CancelledError:
            self.cancel()
            raise
        except Exception:  # noqa: BLE001 - result() raises it with the rank's name
            pass
        return self.result()

    def result(self) -> Any:
        """The value of a finished call, or its error (named after the method and the rank)."""
        ep, what, role = self.ep, self.what, self.role
        try:
            reply = self.client.result(self.op, self.fut.result())
        except _RankLost as e:
            raise WorkerDiedError(f"{what} on {ep.where(role)} cannot finish: {e.err}",
                                  rank=ep.rank, role=role or "", method=what) from None
        except WorkerDiedError:  # the rank was dead before the call: its own error, as is
            raise
        except RpcTimeout:
            raise WorkerCallTimeout(
                f"{what} on {ep.where(role)} got no reply within {self.timeout:.1f}s (the worker may still be "
                "running it; later calls to this rank queue behind it)",
                rank=ep.rank, role=role or "", method=what) from None
        except RemoteError as e:  # the server could not run or encode the call at all
            raise WorkerError(f"{what} on {ep.where(role)} failed in the control plane: {e}",
                              rank=ep.rank, role=role or "", method=what) from None
        if "err" in reply:
            err = reply["err"]
            raise WorkerError(f"{what} failed on {ep.where(role)}: {err['type']}: {err['msg']}\n"
                              f"--- remote traceback (rank {ep.rank}) ---\n{err['tb']}",
                              rank=ep.rank, role=role or "", method=what, remote_tb=err["tb"])
        return from_wire(reply["ok"])


def spin_calls(calls: list[RankCall], budget_s: float) -> bool:
    """Busy-poll the calls' sockets until every call has its reply or ``budget_s`` has
    passed (``RpcClient.spin``); True if all are done."""
    return RpcClient.spin([c.client for c in calls], lambda: all(c.fut.done() for c in calls), budget_s)


async def wait_calls(calls: list[RankCall]) -> None:
    """Until every call has its reply, or one has failed (whichever comes first).

    One waiter future and a done-callback per call: no task per rank. Cancelling the
    wait cancels the calls."""
    pending = [c.fut for c in calls if not c.fut.done()]
    if not pending or any(_failed(c.fut) for c in calls if c.fut.done()):
        return
    waiter = asyncio.get_running_loop().create_future()
    left = len(pending)

    def on_done(fut: asyncio.Future) -> None:
        nonlocal left
        left -= 1
        if not waiter.done() and (left == 0 or _failed(fut)):
            waiter.set_result(None)
    for fut in pending:
        fut.add_done_callback(on_done)
    try:
        await waiter
    except asyncio.CancelledError:
        for c in calls:
            c.cancel()
        raise
    finally:
        for fut in pending:
            fut.remove_done_callback(on_done)


class RankEndpoint:
    """One worker process as the driver sees it."""

    def __init__(self, rank: int, address: str, ctx: zmq.asyncio.Context):
        self.rank = rank
        _, control = split_address(address)
        self.address = calls_address(address)  # a Unix socket for a rank on this host, else TCP
        self.roles: list[str] = []
        self.info: dict = {}
        self._rpc = RpcClient(self.address, ctx)  # calls, run in order by the worker's own thread
        self._control = RpcClient(control, ctx)  # pings and the like, answered while a call runs
        self.dead: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dead.add_done_callback(lambda f: f.exception())  # retrieved: no "never retrieved" noise
        # The calls sent to the calls socket, so a run stopped from outside can say what it
        # waited for. Finished ones are dropped lazily, in bulk (no callback per call: the
        # hot path); ``_prune_at`` doubles with the calls truly in flight.
        self._sent: dict[int, RankCall] = {}
        self._prune_at = 64

    @property
    def in_process(self) -> bool:
        """This rank's worker serves on a thread of this very process (rank 0 under the launcher)."""
        return self.info.get("pid") == os.getpid() and self.info.get("host") == socket.gethostname()

    def where(self, role: str | None = None) -> str:
        roles = role or ",".join(self.roles) or "no role yet"
        host = f" pid {self.info['pid']} on {self.info['host']}" if self.info else ""
        return f"rank {self.rank} ({roles}{host}, {self.address})"

    def start(self, op: str, what: str, role: str | None, timeout: float, args: list, *,
              control: bool = False) -> RankCall:
        """Send one RPC to this rank now (``args``: ``RpcClient.encode_args`` frames). A rank
        already declared dead gets nothing: the call fails with its WorkerDiedError."""
        client = self._control if control else self._rpc
        if self.dead.done():
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(self.dead.exception())
            return RankCall(self, client, -1, fut, op, what, role, timeout)
        rid, fut = client.start(op, args, timeout)
        call = RankCall(self, client, rid, fut, op, what, role, timeout)
        if not control:  # pings and the like are not what a run waits for
            sent = self._sent
            sent[rid] = call
            if len(sent) > self._prune_at:
                self._sent = {r: c for r, c in sent.items() if not c.fut.done()}
                self._prune_at = max(64, 2 * len(self._sent))
        return call

    def in_flight(self) -> list[RankCall]:
        """The calls to this rank (not control messages) that have no reply yet, oldest first."""
        return [c for c in list(self._sent.values()) if not c.fut.done()]

    async def request(self, op: str, what: str, role: str | None, timeout: float, /, *, control: bool = False,
                      **args: Any) -> Any:
        """One RPC to this rank, failing early if the rank is declared dead meanwhile."""
        return await self.start(op, what, role, timeout, RpcClient.encode_args(args), control=control).wait()

    def declare_dead(self, err: WorkerDiedError) -> None:
        """Fail every call in flight to this rank now, and every later one at once."""
        self.dead.set_exception(err)
        lost = _RankLost(err)
        self._rpc.fail_all(lost)
        self._control.fail_all(lost)

    async def ping(self, timeout: float) -> dict:
        return await self._control.call("ping", _timeout=timeout)

    async def close(self) -> None:
        await self._rpc.close()
        await self._control.close()


class Driver:
    """Talks to every worker rank; makes worker groups; notices dead workers.

    ``async with Driver(addresses, ...) as driver:`` or ``await driver.start()`` /
    ``await driver.shutdown()``. Use ``await driver.run(main(driver))`` to run the
    algorithm so that a dead worker stops it even when no call is in flight.
    """

    def __init__(self, addresses: list[str], *, placement: PlacementConfig | None = None,
                 config: DriverConfig | None = None, transfer_queue_address: str | None = None):
        self.addresses = list(addresses)
        self.placement = placement or PlacementConfig()
        self.config = config or DriverConfig()
        self.transfer_queue_address = transfer_queue_address
        self.ranks: list[RankEndpoint] = []
        self.failed: asyncio.Future | None = None
        self._monitors: list[asyncio.Task] = []
        self._heartbeats_stopped = False
        self._create_lock: asyncio.Lock | None = None
        self._ctx = zmq.asyncio.Context()

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    async def start(self) -> "Driver":
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
                    log.error("%s", err)
                    ep.declare_dead(err)
                    if not self.failed.done():
                        self.failed.set_exception(err)
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
            raise self.failed.exception()

    async def run(self, main: Awaitable[T]) -> T:
        """Await ``main``; if a worker dies first, cancel it and raise the WorkerDiedError."""
        task = asyncio.ensure_future(main)
        await asyncio.wait([task, self.failed], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=5)
            self.check()
        return task.result()

    async def set_transfer_queue(self, address: str) -> None:
        self.transfer_queue_address = address
        await asyncio.gather(*(ep.request("set_transfer_queue", "set_transfer_queue", None, 30.0, control=True,
                                          address=address) for ep in self.ranks))

    async def create_group(self, cls: type, role: str, *, ranks: list[int] | None = None,
                           dp_size: int | None = None, **init_kwargs: Any) -> "WorkerGroup":
        """Start a worker of ``cls`` as ``role`` on its ranks (from the placement unless given)."""
        from .worker_group import WorkerGroup

        self.check()
        ranks = list(ranks) if ranks is not None else self.placement.ranks_for(role, self.world_size)
        layout = GroupLayout(role, tuple(ranks), dp_size or self.placement.dp_size_for(role, len(ranks)))
        path = class_path(cls)
        wire_kwargs = to_wire(init_kwargs)
        # new_group is collective over the whole world and must run in the same order on
        # every rank: one creation at a time, sent to every rank.
        async with self._create_lock:
            await asyncio.gather(*(
                ep.request("create_group", f"{role}.__init__", role, self.config.create_timeout_s,
                           layout=layout.to_wire(), cls=path, init_kwargs=wire_kwargs, member=ep.rank in ranks)
                for ep in self.ranks))
        for r in ranks:
            self.ranks[r].roles.append(role)
        return WorkerGroup(self, layout, cls)

    async def make_group(self, ranks: list[int], backend: str = "gloo", timeout_s: float = 300.0) -> None:
        """A process group of these ranks, made on every rank in the same order (a collective over
        the world, like create_group); its members' workers get it from ``group_of(ranks)``."""
        self.check()
        async with self._create_lock:
            await asyncio.gather(*(
                ep.request("make_group", f"make_group({sorted(ranks)})", None, self.config.create_timeout_s,
                           ranks=sorted(int(r) for r in ranks), backend=backend, timeout_s=timeout_s)
                for ep in self.ranks))

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

    async def __aenter__(self) -> "Driver":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()
