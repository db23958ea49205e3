"""Running the TransferQueue: the controller and storage units as asyncio services.

``TransferQueueService`` runs the controller and (by default) one storage unit in one
event loop: the driver's own (``await service.start()``) or a private thread
(``service.start_in_thread()``). Storage units in other processes (one per node)
run ``serve_storage_unit`` and register with the controller. Services bind to the
given interface only (loopback unless told otherwise), never to all interfaces.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from ..rpc.alloc import keep_freed_memory
from ..rpc.async_client import RpcClient
from ..rpc.async_server import RpcServer
from ..rpc.local_endpoint import LocalEndpoint
from ..rpc.loop_thread import EventLoopThread
from ..rpc.thread_endpoint import serve_in_process, withdraw
from .controller import Controller
from .errors import TransferQueueTimeout
from .storage import StorageUnit

log = logging.getLogger(__name__)


@dataclass
class TransferQueueConfig:
    host: str = "127.0.0.1"  # interface to bind; the rendezvous interface in multi-node runs
    num_local_units: int = 1  # storage units inside the controller's process
    max_rows_per_unit: int | None = None  # backpressure bounds (None: unbounded)
    max_bytes_per_unit: int | None = None
    wait_timeout_s: float = 300.0  # default wait of get_meta and of a put waiting for room
    # Let this process's allocator keep freed message memory (alloc.keep_freed_memory): off
    # here, as this service usually runs in the driver, which also trains.
    keep_freed_memory: bool = False


class TransferQueueService:
    def __init__(self, config: TransferQueueConfig | None = None):
        self.config = config or TransferQueueConfig()
        self.controller: Controller | None = None
        self.units: list[StorageUnit] = []
        self._servers: list[RpcServer] = []
        self._thread: EventLoopThread | None = None
        self.controller_address = ""

    async def start(self) -> TransferQueueService:
        cfg = self.config
        if cfg.keep_freed_memory:
            keep_freed_memory()
        ctx = zmq.asyncio.Context.instance()
        # Clients of this process (the driver's, beside a service run by its rank) call in directly.
        loop = asyncio.get_running_loop()
        self.controller = Controller(default_timeout=cfg.wait_timeout_s)
        server = RpcServer(self.controller, f"tcp://{cfg.host}:0", ctx, "tq-controller")
        server.start()
        self._servers.append(server)
        self.controller_address = server.address
        serve_in_process(server.address, self.controller, loop)
        local_controller = LocalEndpoint(self.controller, "controller", timeout_error=TransferQueueTimeout)
        for i in range(cfg.num_local_units):
            unit = StorageUnit(i, local_controller, cfg.max_rows_per_unit, cfg.max_bytes_per_unit,
                               cfg.wait_timeout_s)
            userver = RpcServer(unit, f"tcp://{cfg.host}:0", ctx, f"tq-unit-{i}")
            userver.start()
            self._servers.append(userver)
            serve_in_process(userver.address, unit, loop)
            self.units.append(unit)
            self.controller.attach_unit(i, LocalEndpoint(unit, f"unit-{i}", timeout_error=TransferQueueTimeout),
                                        userver.address)
        return self

    def start_in_thread(self) -> TransferQueueService:
        self._thread = EventLoopThread("tq-service")
        self._thread.run(self.start(), timeout=30)
        return self

    async def stop(self) -> None:
        for s in self._servers:
            withdraw(s.address)
            await s.close()
        self._servers.clear()
        if self.controller is not None:  # connections to units in other processes
            for ep in self.controller.units.values():
                await ep.close()

    def stop_in_thread(self) -> None:
        if self._thread is not None:
            self._thread.run(self.stop(), timeout=10)
            self._thread.stop()
            self._thread = None


async def serve_storage_unit(controller_address: str, index: int, host: str = "127.0.0.1",
                             max_rows: int | None = None, max_bytes: int | None = None,
                             wait_timeout_s: float = 300.0, ready: Any = None) -> None:
    """Run a storage unit in this process until cancelled; it registers with the controller."""
    ctx = zmq.asyncio.Context.instance()
    controller = RpcClient(controller_address, ctx, timeout=60.0, timeout_error=TransferQueueTimeout)
    unit = StorageUnit(index, controller, max_rows, max_bytes, wait_timeout_s)
    server = RpcServer(unit, f"tcp://{host}:0", ctx, f"tq-unit-{index}")
    server.start()
    await controller.call("register_unit", index=index, address=server.address)
    log.info("storage unit %d serving at %s", index, server.address)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
        await controller.close()
