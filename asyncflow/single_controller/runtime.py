"""The worker side of the control plane: one per rank.

Two servers with one protocol (``asyncflow.rpc``'s): calls (create a group, run a method,
shut down) arrive at a ``BlockingRpcServer`` served by ``serve()`` on the worker's own
thread (the main thread on ranks > 0), one at a time and in arrival order. So torch
compute is plain synchronous code, calls never overlap on a rank, and collectives run
in the same order on every rank of a group (the driver sends a group call to all its
ranks back to back). Control messages (heartbeat pings, the TransferQueue address,
"exit now") go to an ``RpcServer`` on a private event-loop thread, so they are
answered while a method runs; so do the methods a worker registers ``concurrent=True``
(a service's control calls), each run on a pool thread. A watchdog exits the process when the driver's pings stop
(or, for LocalWorkers' ranks, when the process that started it is gone).
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import zmq
import zmq.asyncio

from ..platform import Platform
from ..rpc.alloc import refreeze_gc_heap
from ..rpc.async_server import RpcServer
from ..rpc.blocking_server import BlockingRpcServer
from ..rpc.loop_thread import EventLoopThread
from ..transfer_queue.client import TransferQueueClient
from .dispatch import Execute, get_dispatch_mode, method_spec
from .layout import GroupLayout
from .wire import from_wire, to_wire
from .worker import Worker, WorkerContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_Target = tuple[Worker, Callable[..., Any], Execute]  # a registered method: worker, bound method, execute

log = logging.getLogger(__name__)


def join_address(calls: str, control: str, local: str | None = None) -> str:
    """One string per rank in the store: ``<calls address>|<control address>``, plus
    ``|<host key> <ipc:// calls address>`` when the worker also takes calls on a Unix
    socket, for a driver on the same host (see :func:`calls_address`)."""
    key = host_key() if local else None
    return f"{calls}|{control}" + (f"|{key} {local}" if key else "")


def split_address(address: str) -> tuple[str, str]:
    """``(TCP calls address, control address)`` of a worker address."""
    parts = address.split("|")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"worker address {address!r} must be '<calls>|<control>[|<host key> <ipc address>]'")
    return parts[0], parts[1]


def calls_address(address: str) -> str:
    """Where this process should send calls to the worker at ``address``: its ``ipc://``
    socket when that worker shares this kernel and network namespace (the same host key),
    else its TCP address (other nodes, other containers)."""
    calls, _ = split_address(address)
    parts = address.split("|")
    if len(parts) == 3:
        key, _, local = parts[2].partition(" ")
        if local.startswith("ipc://@") and key == host_key():
            return local
    return calls


def host_key() -> str | None:
    """This kernel (its boot id, random per boot and host) and network namespace (its inode):
    processes with the same key reach each other's abstract Unix sockets. None off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def ipc_address() -> str | None:
    """A fresh ``ipc://`` address in Linux's abstract socket namespace (no file: nothing is
    left behind, even by a killed process), or None where that is unavailable."""
    if not zmq.has("ipc") or host_key() is None:
        return None
    return f"ipc://@asyncflow-{os.getpid()}-{secrets.token_hex(8)}"


@dataclass
class RuntimeConfig:
    collective_timeout_s: float = 300.0  # new_group and every collective of the groups it makes
    driver_timeout_s: float = 10.0  # exit when the driver's pings stop for this long
    attach_timeout_s: float = 300.0  # exit when no driver pinged at all within this long
    # Exit when this process is no longer a child of that pid: set by LocalWorkers, whose
    # process holds the driver, so its workers go with it even before the first ping.
    parent_pid: int | None = None
    # Also take calls on a Unix socket, which a driver on the same host uses instead of TCP
    # loopback (it skips the TCP stack, so a small call's round trip is shorter); other nodes
    # use TCP.
    local_ipc: bool = True
    # False: this rank makes no torch.distributed groups (its workers see None for every group
    # and run no collectives), so many ranks can share one process: the simulated ranks of
    # asyncflow.simulation, which serve the real calls without a device or a process group.
    collectives: bool = True


def import_class(path: str) -> type:
    """``'package.module:Class'`` -> the class."""
    mod, _, name = path.partition(":")
    if not mod or not name:
        raise ValueError(f"worker class path {path!r} must look like 'package.module:ClassName'")
    obj: Any = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    cls: type = obj  # what the path names: the callers check it is a class (and which)
    return cls


def class_path(cls: type) -> str:
    if "<locals>" in cls.__qualname__:
        raise ValueError(f"worker class {cls.__qualname__} is defined inside a function: workers import "
                         "it by name, define it at module level")
    return f"{cls.__module__}:{cls.__qualname__}"


class _CallService:
    """Served by ``serve()`` on the worker thread: the work, in order."""

    def __init__(self, rt: WorkerRuntime):
        self.rt = rt

    def rpc_create_groups(self, groups: list[Any]) -> dict[str, Any]:
        roles = ", ".join(g["layout"]["role"] for g in groups)
        return self.rt._guarded(f"create_groups({roles})", self.rt._create_all, groups)

    def rpc_make_group(self, ranks: list[Any], backend: str, timeout_s: float) -> dict[str, Any]:
        return self.rt._guarded(f"make_group({ranks})", self.rt._make_group, [int(r) for r in ranks], backend,
                                timeout_s)

    def rpc_call(self, role: str, fn: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        # "fn", not "method": RpcClient.call's own first parameter is called method
        return self.rt._guarded(f"{role}.{fn}", self.rt._call, role, fn, from_wire(args), from_wire(kwargs))

    def rpc_freeze_heap(self) -> dict[str, Any]:
        """Keep what this rank has built so far (models, data) out of later garbage collections
        (alloc.refreeze_gc_heap): on the call queue, so no method is running."""
        return self.rt._guarded("freeze_heap", lambda: {"frozen": refreeze_gc_heap()})

    def rpc_shutdown(self) -> dict[str, Any]:
        self.rt._closing = True
        self.rt._calls.stopping = True
        return {"ok": None}


class _ControlService:
    """Served on the event-loop thread: answered even while a method runs."""

    def __init__(self, rt: WorkerRuntime):
        self.rt = rt

    async def rpc_ping(self) -> dict[str, Any]:
        self.rt._last_ping = time.monotonic()
        return {"rank": self.rt.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "busy": self.rt._busy, "roles": sorted(self.rt.workers),
                "auth_failures": self.rt.auth_failures()}

    async def rpc_set_transfer_queue(self, address: str) -> dict[str, Any]:
        self.rt._tq_address = address
        return {"ok": None}

    async def rpc_call_concurrent(self, role: str, fn: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A method registered ``concurrent=True``: run on a pool thread, beside the call queue."""
        rt = self.rt
        return await asyncio.get_running_loop().run_in_executor(
            rt._pool, rt._guarded_concurrent, f"{role}.{fn}", role, fn, from_wire(args), from_wire(kwargs))

    async def rpc_exit_now(self) -> dict[str, Any]:
        """The run failed and a call here may run for a long time yet: exit a moment after
        this reply has left (a normal exit could wait on a collective that never ends)."""
        self.rt._closing = True
        print(f"asyncflow worker rank {self.rt.rank} exits: the driver stopped the run after a failure "
              f"(busy with {self.rt._busy or 'nothing'!r})", flush=True)
        asyncio.get_running_loop().call_later(0.2, os._exit, 4)
        return {"ok": None}


class WorkerRuntime:
    def __init__(self, rank: int, world_size: int, local_rank: int, platform: Platform, host: str,
                 config: RuntimeConfig | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.platform = platform
        self.config = config or RuntimeConfig()
        self.workers: dict[str, Worker] = {}
        self._targets: dict[tuple[str, str], _Target] = {}  # (role, method) -> worker, bound method, execute
        self._active_role: str | None = None
        self._busy = ""
        self._tq_address: str | None = None
        # Driver.make_group's groups, this rank a member
        self._made_groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        self._tq: TransferQueueClient | None = None
        self._last_ping: float | None = None
        self._closing = False
        self._started = time.monotonic()
        self._zmq = zmq.Context()  # private: the worker's TransferQueueClient uses the global one
        # threads for concurrent methods (a service's control calls; a few at once at most)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"worker-{rank}-concurrent")
        self._calls = BlockingRpcServer(_CallService(self), f"tcp://{host}:0", self._zmq, f"worker-{rank}")
        self._loop = EventLoopThread(f"worker-control-{rank}")
        self._control: RpcServer | None = None
        local = ipc_address() if self.config.local_ipc else None
        local = self._calls.listen_also(local) if local else None
        self.address = join_address(self._calls.address, self._loop.run(self._start_control(host), timeout=30), local)
        threading.Thread(target=self._watch_driver, name=f"driver-watchdog-{rank}", daemon=True).start()

    async def _start_control(self, host: str) -> str:
        self._control = RpcServer(_ControlService(self), f"tcp://{host}:0", zmq.asyncio.Context(),
                                  f"worker-{self.rank}-control")
        self._control.start()
        return self._control.address

    def auth_failures(self) -> int:
        """Messages both servers dropped for failing authentication (a stranger is sending)."""
        return self._calls.auth_failures + (self._control.auth_failures if self._control is not None else 0)

    # ---- the call loop -------------------------------------------------------------------
    def serve(self) -> None:
        """Run calls in arrival order until the driver says shutdown."""
        self._calls.serve_forever()

    def _guarded(self, what: str, fn: Any, *args: Any) -> dict[str, Any]:
        """Run one call; any failure goes back to the driver with its traceback."""
        self._busy = what
        try:
            return {"ok": fn(*args)}
        except Exception as e:  # noqa: BLE001 - the worker method's error goes back to the driver
            return {"err": {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}}
        finally:
            self._busy = ""

    def _guarded_concurrent(self, what: str, role: str, method: str, args: list[Any],
                            kwargs: dict[str, Any]) -> dict[str, Any]:
        """A concurrent call: errors go back like any call's; the rank's busy note is left alone."""
        try:
            worker, fn, execute = self._target(role, method)
            spec = method_spec(fn)
            if spec is None or not spec.concurrent:
                raise PermissionError(f"{what} is not registered concurrent=True; it runs in the call queue")
            return {"ok": to_wire(execute(worker, fn, tuple(args), kwargs))}
        except Exception as e:  # noqa: BLE001 - the worker method's error goes back to the driver
            return {"err": {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}}

    def _target(self, role: str, method: str) -> _Target:
        target = self._targets.get((role, method))
        if target is None:
            worker = self.workers.get(role)
            if worker is None:
                raise KeyError(f"rank {self.rank} runs no worker of role {role!r} (it has {sorted(self.workers)})")
            fn = getattr(worker, method, None)
            spec = method_spec(fn)
            if fn is None or spec is None:
                raise AttributeError(f"{type(worker).__name__}.{method} is not a method marked with @register")
            target = self._targets[(role, method)] = (worker, fn, get_dispatch_mode(spec.mode).execute)
        return target

    def _call(self, role: str, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        worker, fn, execute = self._target(role, method)
        if self._active_role != role:
            self._switch_to(role)
        return to_wire(execute(worker, fn, tuple(args), kwargs))

    def _switch_to(self, role: str) -> None:
        """Colocated roles take turns on this rank: offload the last one, onload this one. A
        role that does not ``needs_device`` runs beside the loaded one: nothing moves."""
        worker = self.workers[role]
        if self._active_role == role or not worker.needs_device:
            return
        if self._active_role is not None:
            self.workers[self._active_role].offload()
            # None until the onload below succeeds: if it raises, the next call of either role
            # onloads again instead of running on state that was moved away.
            self._active_role = None
        worker.onload()
        self._active_role = role

    def _create_all(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``_create`` for each group, in the driver's order; the first failure names its role."""
        out = []
        for g in groups:
            layout = GroupLayout.from_wire(g["layout"])
            try:
                out.append(self._create(layout, g["cls"], from_wire(g["init_kwargs"]), bool(g["member"])))
            except Exception as e:
                msg = f"rank {self.rank}: creating group {layout.role!r} ({g['cls']}): {e}"
                try:  # keep the type the driver reports; one whose constructor differs gets RuntimeError
                    wrapped = type(e)(msg)
                except Exception:  # noqa: BLE001 - any constructor that does not take one message
                    wrapped = RuntimeError(msg)
                raise wrapped from e
        refreeze_gc_heap()  # the models just built stay out of the collections to come
        return out

    def _create(self, layout: GroupLayout, cls_path: str, init_kwargs: dict[str, Any], member: bool) -> dict[str, Any]:
        """Every rank of the world runs this (new_group is collective over the world), in
        the same order; only members build the worker."""

        timeout = timedelta(seconds=self.config.collective_timeout_s)

        made: dict[tuple[int, ...], ProcessGroup | None] = {}

        def group(ranks: list[int]) -> ProcessGroup | None:  # a single rank needs no communicator; the same ranks, one
            key = tuple(ranks)
            if len(key) > 1 and key not in made and self.config.collectives:
                made[key] = dist.new_group(ranks, timeout=timeout, backend=self.platform.backend)
            return made.get(key)

        whole = group(list(layout.ranks))
        shards = [group(layout.shard_ranks(s)) for s in range(layout.dp_size)]
        peers = [group(layout.dp_peers(p)) for p in range(layout.shard_size)]
        if not member:
            return {"rank": self.rank}
        if layout.role in self.workers:
            raise ValueError(f"rank {self.rank} already runs a worker of role {layout.role!r}")
        cls = import_class(cls_path)
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"{cls_path} is not a subclass of asyncflow.single_controller.Worker")
        index = layout.ranks.index(self.rank)
        ctx = WorkerContext(self.rank, self.world_size, self.local_rank, layout, self.platform, whole,
                            shards[layout.shard_of(index)], peers[index % layout.shard_size], self._tq_client,
                            self._group_of)
        worker = cls.__new__(cls)
        worker._ctx = ctx  # set before __init__ so it can use rank, device and groups
        cls.__init__(worker, **init_kwargs)
        self.workers[layout.role] = worker
        return {"rank": self.rank, "pid": os.getpid()}

    def _make_group(self, ranks: list[int], backend: str, timeout_s: float) -> None:
        """Every rank runs this, in the same order (new_group is collective over the world, and
        torch names a group by what each process made before it: a group made by its members alone
        gets a different name on a rank that made another one first)."""

        key = tuple(sorted(ranks))
        if len(key) < 2 or key in self._made_groups:
            return None
        if not self.config.collectives:  # a simulated rank: members get None, as a lone rank does
            if self.rank in key:
                self._made_groups[key] = None
            return None
        group = dist.new_group(list(key), timeout=timedelta(seconds=timeout_s), backend=backend)
        if self.rank in key:
            self._made_groups[key] = group
        return None

    def _group_of(self, ranks: list[int]) -> ProcessGroup | None:
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self._made_groups:
            raise KeyError(f"rank {self.rank}: no group of ranks {list(key)} was made for it (the driver makes "
                           f"one with make_group before a worker uses it); made: {sorted(self._made_groups)}")
        return self._made_groups[key]

    def _tq_client(self) -> TransferQueueClient:
        if self._tq is None:
            if self._tq_address is None:
                raise RuntimeError(f"rank {self.rank}: no TransferQueue address was given to this worker "
                                   "(Driver(transfer_queue_address=...))")
            self._tq = TransferQueueClient(self._tq_address)
        return self._tq

    # ---- driver liveness -----------------------------------------------------------------
    def _watch_driver(self) -> None:
        cfg = self.config
        while True:
            time.sleep(0.5)
            now, last = time.monotonic(), self._last_ping
            if self._closing:
                return
            if cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:  # reparented: it died
                why = f"the process that started it (pid {cfg.parent_pid}) is gone"
            elif last is None and now - self._started > cfg.attach_timeout_s:
                why = f"no driver pinged within {cfg.attach_timeout_s:.0f}s of start"
            elif last is not None and now - last > cfg.driver_timeout_s:
                why = f"the driver's heartbeat stopped {now - last:.1f}s ago"
            else:
                continue
            # os._exit: a normal exit would wait on a collective or a thread that may never end.
            log.error("worker rank %d exits: %s (busy with %r)", self.rank, why, self._busy or "nothing")
            print(f"asyncflow worker rank {self.rank} exits: {why}", flush=True)
            os._exit(3)

    def close(self) -> None:
        for role, worker in self.workers.items():  # each worker's own teardown (e.g. sends still on the wire)
            teardown = getattr(worker, "teardown", None)  # Worker's is a no-op
            try:
                if callable(teardown):
                    teardown()
            except Exception:  # shutting down: reported, the rest still closes
                log.exception("rank %d: the teardown of worker %r failed", self.rank, role)
        self._calls.close()

        async def stop() -> None:
            if self._control is not None:
                await self._control.close()
        try:
            self._loop.run(stop(), timeout=10)
        finally:
            self._loop.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._tq is not None:
            self._tq.close()
        self._zmq.destroy(linger=0)

