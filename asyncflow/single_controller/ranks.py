"""The driver's connection to one worker rank, and its calls in flight.

Each rank is reached through an ``RpcClient`` (calls multiplexed on one DEALER
socket) plus a second client used only for heartbeats, so a ping never queues behind a
large message. ``RankEndpoint.start`` sends one call and returns its ``RankCall``;
``spin_calls`` and ``wait_calls`` wait for a group of them (``worker_group``). The
``driver`` uses this module and ``worker_group``; neither imports the driver.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import zmq.asyncio

from ..rpc.async_client import RpcClient
from ..rpc.errors import RemoteError, RpcTimeout
from .errors import WorkerCallTimeout, WorkerDiedError, WorkerError
from .runtime import calls_address, split_address
from .wire import from_wire


class _RankLost(Exception):
    """Set on the calls in flight to a rank declared dead; turned into WorkerDiedError."""

    def __init__(self, err: WorkerDiedError):
        super().__init__(str(err))
        self.err = err


def _failed(fut: asyncio.Future[Any]) -> bool:
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

    def __init__(self, ep: RankEndpoint, client: RpcClient, rid: int, fut: asyncio.Future[Any], op: str, what: str,
                 role: str | None, timeout: float):
        self.ep, self.client, self.rid, self.fut = ep, client, rid, fut
        self.op, self.what, self.role, self.timeout = op, what, role, timeout
        self.started = time.monotonic()  # for the report of a run stopped mid-call (Driver.describe_in_flight)

    def describe(self, now: float) -> str:
        """``rank 1 (role train) train.sleep, running 2.1 s``: one call in flight, for a report."""
        role = self.role or ",".join(self.ep.roles) or "no role yet"
        return f"rank {self.ep.rank} (role {role}) {self.what}, running {now - self.started:.1f} s"

    @staticmethod
    def describe_all(calls: list[RankCall]) -> str:
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

    def on_done(fut: asyncio.Future[Any]) -> None:
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
        self.info: dict[str, Any] = {}
        self._rpc = RpcClient(self.address, ctx)  # calls, run in order by the worker's own thread
        self._control = RpcClient(control, ctx)  # pings and the like, answered while a call runs
        self.dead: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
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

    def start(self, op: str, what: str, role: str | None, timeout: float, args: list[Any], *,
              control: bool = False) -> RankCall:
        """Send one RPC to this rank now (``args``: ``RpcClient.encode_args`` frames). A rank
        already declared dead gets nothing: the call fails with its WorkerDiedError."""
        client = self._control if control else self._rpc
        if self.dead.done():
            fut = asyncio.get_running_loop().create_future()
            err = self.dead.exception()  # set by declare_dead, always with its error
            fut.set_exception(err if err is not None else WorkerDiedError(f"{self.where()} is dead", rank=self.rank))
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

    async def ping(self, timeout: float) -> dict[str, Any]:
        info: dict[str, Any] = await self._control.call("ping", _timeout=timeout)
        return info

    async def close(self) -> None:
        await self._rpc.close()
        await self._control.close()
