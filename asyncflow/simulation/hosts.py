"""Host processes of simulated ranks: each runs many real worker runtimes (one per simulated
device: its own call server, control server and TransferQueue client) and, optionally, one
TransferQueue storage unit, as a node of the simulated cluster would.

The ranks make no torch.distributed groups (``RuntimeConfig(collectives=False)``), so
hundreds of them share a process; calls still cross the real RPC (ZMQ, authenticated with
the run's key, which the hosts take from the environment as any process the run starts).
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..platform import get_platform
from ..rpc import auth
from ..single_controller.runtime import RuntimeConfig, WorkerRuntime
from ..transfer_queue import locality
from ..transfer_queue.service import serve_storage_unit
from ..transfer_queue.unit_process import prepare_unit_process


def _unit_main(index: int, controller: str, conn: Any, parent: int) -> None:
    """A node's storage unit in a process of its own: on a cluster it shares its process with one
    worker (a node's local rank 0), not with the hundred ranks of a simulated host."""
    def watch() -> None:  # go with the process that started us
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="sim-unit-watchdog", daemon=True).start()
    prepare_unit_process()  # as a node's unit process is set up

    async def serve() -> None:
        ready = asyncio.Event()

        class _Ready:  # serve_storage_unit sets a threading-style event
            def set(self) -> None:
                ready.set()
                conn.send({"pid": os.getpid()})
        await serve_storage_unit(controller, index, ready=_Ready())
    try:
        asyncio.run(serve())
    except BaseException as e:  # the parent reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def _host_main(ranks: list[int], world: int, unit: int | None, controller: str | None, conn: Any,
               parent: int) -> None:
    """One host process: start the runtimes, send their addresses, serve. ``unit``: the storage
    unit (already registered) that this host's ranks write to."""
    try:
        if unit is not None:
            locality.set_locality(unit, unit)  # this node's ranks write their rows here
        platform = get_platform("cpu")
        # The ranks compute nothing (the device work is a hold): their tensor ops are the control
        # plane's small copies, where intra-op threads only add wake-ups on the shared cores.
        torch.set_num_threads(1)
        # A rank exits after 60 s without the driver's pings (10 s in a run): the hosts share this
        # machine's cores with the driver and with whatever else runs on it.
        cfg = RuntimeConfig(collectives=False, driver_timeout_s=60.0, parent_pid=parent, local_ipc=True)
        runtimes = [WorkerRuntime(r, world, i, platform, "127.0.0.1", cfg) for i, r in enumerate(ranks)]
        for rt in runtimes:
            threading.Thread(target=rt.serve, name=f"sim-rank{rt.rank}", daemon=True).start()
        conn.send({"addresses": [rt.address for rt in runtimes], "pid": os.getpid()})
    except BaseException as e:  # the parent reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise
    conn.recv()  # until the parent says stop (or dies: the runtimes' watchdogs exit then)
    os._exit(0)


@dataclass
class SimHosts:
    """``hosts`` processes sharing ``world`` simulated ranks; ``with_units``: each host also runs
    storage unit ``h`` registered with the controller at ``controller``."""

    world: int
    hosts: int = 2
    controller: str | None = None
    with_units: bool = True
    start_timeout_s: float = 120.0
    addresses: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.with_units and not self.controller:
            raise ValueError("SimHosts with storage units needs the TransferQueue controller's address")
        auth.run_key()  # makes (or reads) this process's key and exports it: the hosts sign with it
        ctx = mp.get_context("spawn")
        per = [list(range(self.world))[h::self.hosts] for h in range(self.hosts)]
        self.ranks_of = [p for p in per if p]
        self._conns, self._procs = [], []
        self.unit_pids: list[int] = []
        if self.with_units:  # first the units, so that every host's unit is registered before its ranks write
            for h in range(len(self.ranks_of)):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_unit_main, name=f"sim-unit{h}", daemon=True,
                                   args=(h, self.controller, theirs, os.getpid()))
                proc.start()
                self._conns.append(mine)
                self._procs.append(proc)
                if not mine.poll(self.start_timeout_s):
                    self.close()
                    raise TimeoutError(f"simulated node {h}'s storage unit did not register within "
                                       f"{self.start_timeout_s:.0f} s")
                msg = mine.recv()
                if "error" in msg:
                    self.close()
                    raise RuntimeError(f"simulated node {h}'s storage unit failed to start: {msg['error']}")
                self.unit_pids.append(msg["pid"])
        hosts_from = len(self._conns)
        for h, ranks in enumerate(self.ranks_of):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_host_main, name=f"sim-host{h}", daemon=True,
                               args=(ranks, self.world, h if self.with_units else None, self.controller, theirs,
                                     os.getpid()))
            proc.start()
            self._conns.append(mine)
            self._procs.append(proc)
        by_rank: dict[int, str] = {}
        try:
            for h, (conn, ranks) in enumerate(zip(self._conns[hosts_from:], self.ranks_of)):
                if not conn.poll(self.start_timeout_s):
                    raise TimeoutError(f"simulated host {h} did not start its {len(ranks)} ranks within "
                                       f"{self.start_timeout_s:.0f} s")
                msg = conn.recv()
                if "error" in msg:
                    raise RuntimeError(f"simulated host {h} failed to start: {msg['error']}")
                by_rank.update(zip(ranks, msg["addresses"]))
                self.pids.append(msg["pid"])
        except BaseException:
            self.close()
            raise
        self.addresses = [by_rank[r] for r in range(self.world)]

    @property
    def units(self) -> int:
        return len(self.ranks_of) if self.with_units else 0

    def close(self) -> None:
        units = [p for p in self._procs if p.name.startswith("sim-unit")]
        for c in self._conns:
            try:
                c.send("stop")
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            if p in units:  # a unit serves until stopped: after the hosts, as a run's units outlive its ranks
                continue
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for p in units:
            p.terminate()
            p.join(5)

    def __enter__(self) -> SimHosts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
