"""Where the TransferQueue's storage units run in a launched job.

The driver's rank runs the TransferQueue service: the controller and one storage unit, in a
child process of its own (``service: own_process``, the default: serving requests never
takes the GIL from the rank's compute) or in threads of rank 0's process (``service:
driver``). ``storage_units: driver`` (the default): that one unit is all. ``per_node``:
each other node's local rank 0 also hosts one unit, index = node index (torchrun's
GROUP_RANK); node 0's is the service's own, since rank 0 is node 0's local rank 0. Every
process on a node writes to its node's unit (``transfer_queue.locality``); reads go
wherever rows live.

Start-up order, all through torchrun's TCPStore: rank 0 starts the controller and puts
its address in the store; each unit-hosting rank waits for it, starts its unit, waits
until the unit registered, and only then publishes its worker address, so once the
driver has every worker address every unit is registered (the driver still checks,
naming the nodes whose unit is missing).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq.asyncio

from ..rpc.async_client import RpcClient
from ..rpc.loop_thread import EventLoopThread
from ..rpc.store_wait import wait_for_value
from ..rpc.waits import wait_within
from ..transfer_queue import (
    AsyncTransferQueueClient,
    TransferQueueConfig,
    TransferQueueError,
    TransferQueueService,
    locality,
)
from ..transfer_queue.service import serve_storage_unit
from ..transfer_queue.service_process import ServiceProcess
from .errors import LaunchError
from .rendezvous import KEY_PREFIX

log = logging.getLogger(__name__)

STORAGE_UNITS = ("driver", "per_node")
SERVICE_PLACES = ("own_process", "driver")
CONTROLLER_KEY = f"{KEY_PREFIX}tq/controller"


@dataclass
class TransferQueueLayout:
    """Where the TransferQueue's service and storage units run, and their bounds: the run
    config's ``transfer_queue`` section (defined here, where it is used, so that this package
    needs nothing of the application's config)."""
    # driver: one storage unit, beside the controller (see service). per_node: one per node,
    # hosted by the node's local rank 0; every process writes to its own node's unit (multi-node runs).
    storage_units: str = field(default="driver", metadata={"choices": STORAGE_UNITS})
    # Where the controller (and the driver's unit) run. own_process: a child process of the
    # driver's rank, so that serving requests never takes the GIL from the rank's compute;
    # driver: threads inside the driver's rank (one process fewer, for the smallest runs).
    service: str = field(default="own_process", metadata={"choices": SERVICE_PLACES})
    max_rows_per_unit: int = 0  # backpressure: a put of new rows waits for room (0: unbounded)
    max_bytes_per_unit: int = 0
    stats_path: str = ""  # rank 0 writes every unit's stats there as JSON at the end ("": out_dir/tq_units.json)
    # the service's own process must be serving, and a node's unit registered, within this
    register_timeout_s: float = 120.0

    @property
    def per_node(self) -> bool:
        return self.storage_units == "per_node"

    def validate(self) -> list[str]:
        """The section's own rules (its choices are checked when the config loads)."""
        if self.max_rows_per_unit < 0 or self.max_bytes_per_unit < 0:
            return [(f"transfer_queue.max_rows_per_unit and max_bytes_per_unit must be >= 0 (0: unbounded), "
                     f"got {self.max_rows_per_unit} and {self.max_bytes_per_unit}")]
        return []


def _node_key(rank: int) -> str:
    return f"{KEY_PREFIX}node/{rank}"



def node_from_env() -> int:
    """This process's node index: torchrun's GROUP_RANK (0 when not under torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def _bound(x: int) -> int | None:
    return x if x > 0 else None


class NodeUnit:
    """One storage unit served on an event-loop thread of its own inside a worker process."""

    def __init__(self, controller_address: str, index: int, host: str, cfg: TransferQueueLayout):

        self.index = index
        self._loop = EventLoopThread(f"tq-unit-{index}")
        self._stopped = False
        ready = threading.Event()

        async def start() -> asyncio.Task[Any]:
            return asyncio.get_running_loop().create_task(serve_storage_unit(
                controller_address, index, host, _bound(cfg.max_rows_per_unit), _bound(cfg.max_bytes_per_unit),
                ready=ready), name=f"tq-unit-{index}")
        self._task = self._loop.run(start(), timeout=30)
        deadline = time.monotonic() + cfg.register_timeout_s
        while not ready.wait(0.1):
            if self._task.done():  # registration failed: say why
                err = self._task.exception() if not self._task.cancelled() else "cancelled"
                self.stop()
                raise LaunchError(f"storage unit {index} (node {index}) could not register with the TransferQueue "
                                  f"controller at {controller_address}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"storage unit {index} (node {index}) did not register with the TransferQueue "
                                  f"controller at {controller_address} within {cfg.register_timeout_s:.0f}s")

    def stop(self) -> None:
        """Close the unit's socket and its connection to the controller, then the thread (once)."""
        if self._stopped:
            return
        self._stopped = True

        async def cancel() -> None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=10)
        try:
            self._loop.run(cancel(), timeout=15)
        except Exception as e:  # noqa: BLE001 - shutting down: report, do not mask the run's outcome
            log.warning("storage unit %d did not stop cleanly: %s", self.index, e)
        finally:
            self._loop.stop()


@dataclass
class RankTransferQueue:
    """What one rank runs of the TransferQueue: the service (driver rank) or a node's unit."""
    service: Any = None
    unit: NodeUnit | None = None

    def stop(self) -> None:
        if self.unit is not None:
            self.unit.stop()
            self.unit = None
        if self.service is not None:
            self.service.stop_in_thread()  # idempotent: run_driver may have stopped it already


def check_units(cfg: TransferQueueLayout) -> None:
    if cfg.storage_units not in STORAGE_UNITS:
        raise LaunchError(f"transfer_queue.storage_units: expected one of {STORAGE_UNITS}, "
                          f"got {cfg.storage_units!r}")
    if cfg.service not in SERVICE_PLACES:
        raise LaunchError(f"transfer_queue.service: expected one of {SERVICE_PLACES}, got {cfg.service!r}")


def start_for_rank(cfg: TransferQueueLayout, store: Any, rank: int, local_rank: int, node: int, host: str,
                   timeout_s: float, *, driver: bool, imports: Sequence[str] = (),
                   on_service_death: Callable[[str], None] | None = None) -> RankTransferQueue:
    """Before the rank publishes its worker address. The driver's rank starts the controller
    (and node 0's unit; in a process of its own, ``imports`` imported there first,
    ``on_service_death`` called if it dies) and puts the controller's address in the store; with ``per_node``,
    local rank 0 of every other node starts its node's unit and waits until it registered."""

    check_units(cfg)
    out = RankTransferQueue()
    store.set(_node_key(rank), str(node))
    if driver:
        if cfg.per_node and node != 0:
            raise LaunchError(f"the driver's rank {rank} is on node {node}: with transfer_queue.storage_units="
                              "per_node it must be on node 0 (torchrun puts rank 0 on node rank 0)")
        locality.set_locality(node, 0 if cfg.per_node else None)
        service_cfg = TransferQueueConfig(host=host, max_rows_per_unit=_bound(cfg.max_rows_per_unit),
                                          max_bytes_per_unit=_bound(cfg.max_bytes_per_unit))
        if cfg.service == "own_process":
            try:
                out.service = ServiceProcess(service_cfg, start_timeout_s=cfg.register_timeout_s, imports=imports,
                                             on_death=on_service_death)
            except TransferQueueError as e:
                raise LaunchError(f"rank {rank}: {e}") from None
        else:
            out.service = TransferQueueService(service_cfg).start_in_thread()
        store.set(CONTROLLER_KEY, out.service.controller_address)
        return out
    locality.set_locality(node, node if cfg.per_node else None)
    if not (cfg.per_node and local_rank == 0 and node != 0):
        return out
    try:
        controller = wait_for_value(store, CONTROLLER_KEY, timeout_s, f"rank {rank} (node {node})",
                                    "the TransferQueue controller's address")
    except TimeoutError as e:
        raise LaunchError(str(e)) from None
    out.unit = NodeUnit(controller.decode(), node, host, cfg)
    log.info("rank %d hosts the TransferQueue storage unit of node %d", rank, node)
    return out


def nodes_of_ranks(store: Any, world_size: int) -> list[int]:
    """Every rank's node (read after every worker published its address, so all are set)."""
    return [int(store.get(_node_key(r)).decode()) for r in range(world_size)]


async def wait_for_node_units(controller_address: str, nodes: list[int], timeout_s: float) -> None:
    """Until every node's unit is registered with the controller; names the missing ones."""


    want = sorted(set(nodes))
    ctx = zmq.asyncio.Context()
    client = RpcClient(controller_address, ctx, timeout=10.0)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            have = {int(k) for k in (await client.call("info"))["units"]}
            missing = [n for n in want if n not in have]
            if not missing:
                return
            if time.monotonic() > deadline:
                ranks = {n: [r for r, x in enumerate(nodes) if x == n] for n in missing}
                raise LaunchError(f"the TransferQueue storage units of nodes {missing} did not register within "
                                  f"{timeout_s:.0f}s (their local rank 0: {ranks}); registered units: {sorted(have)}")
            await asyncio.sleep(0.1)
    finally:
        await client.close()
        ctx.destroy(linger=0)


async def write_unit_stats(controller_address: str, path: str) -> list[dict[str, Any]] | None:
    """Every unit's stats (rows, bytes, rows put by each writer's node) as JSON at ``path``.
    Best effort: the run's outcome does not depend on it."""
    if not path:
        return None


    ctx = zmq.asyncio.Context()
    client = AsyncTransferQueueClient(controller_address, timeout=10.0, ctx=ctx)
    try:
        stats = sorted(await wait_within(client.unit_stats(), 15.0), key=lambda s: s["unit"])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(stats, indent=2))
        return stats
    except Exception as e:  # noqa: BLE001 - statistics only
        log.warning("could not write the TransferQueue unit stats to %s: %s", path, e)
        return None
    finally:
        await client.close()
        ctx.destroy(linger=0)
