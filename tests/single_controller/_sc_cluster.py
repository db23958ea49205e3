"""A real cluster for the multi-process tests: worker ranks in child processes, the
driver (and a TransferQueueService) in this process on a private event loop.
Every wait has a short timeout, so a bug fails a test instead of hanging the suite.
(A module of its own: ``conftest`` is not a unique module name across test folders.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from asyncflow.rpc.loop_thread import EventLoopThread
from asyncflow.single_controller import Driver, DriverConfig, LaunchConfig, RolePlacement, RuntimeConfig
from asyncflow.transfer_queue import AsyncTransferQueueClient, TransferQueueService

FAST_DRIVER = DriverConfig(call_timeout_s=30.0, create_timeout_s=60.0, heartbeat_interval_s=0.5,
                           heartbeat_timeout_s=1.5, heartbeat_misses=2, attach_timeout_s=60.0)


def run_config(driver_timeout_s: float = 10.0) -> LaunchConfig:
    return LaunchConfig(platform="cpu", rendezvous_timeout_s=60.0,
                     runtime=RuntimeConfig(collective_timeout_s=60.0, driver_timeout_s=driver_timeout_s,
                                           attach_timeout_s=60.0))


@dataclass
class Cluster:
    workers: Any  # LocalWorkers
    loop: EventLoopThread
    driver: Driver
    tq: TransferQueueService

    def run(self, coro, timeout: float = 60.0) -> Any:
        return self.loop.run(coro, timeout=timeout)

    def tq_client(self) -> AsyncTransferQueueClient:
        return AsyncTransferQueueClient(self.tq.controller_address, timeout=20, wait_timeout=5)


def start_cluster(world_size: int, placement: RolePlacement | None = None,
                  driver_timeout_s: float = 10.0) -> Cluster:
    from asyncflow.single_controller.local import LocalWorkers

    tq = TransferQueueService().start_in_thread()
    workers = LocalWorkers(world_size, run_config(driver_timeout_s))
    loop = EventLoopThread("test-driver")
    driver = Driver(workers.addresses, placement=placement, config=FAST_DRIVER,
                    transfer_queue_address=tq.controller_address)
    loop.run(driver.start(), timeout=60)
    return Cluster(workers, loop, driver, tq)


def stop_cluster(c: Cluster) -> None:
    try:
        c.loop.run(c.driver.shutdown(), timeout=30)
    finally:
        c.loop.stop()
        c.workers.close(timeout=15)
        c.tq.stop_in_thread()


def cluster_fixture(world_size: int, placement: RolePlacement | None = None, driver_timeout_s: float = 10.0):
    """A module-scoped fixture with a cluster of ``world_size`` ranks, stopped after the module's
    tests; its name is the name it is assigned to (``cluster4 = cluster_fixture(4)``)."""
    @pytest.fixture(scope="module")
    def cluster():
        c = start_cluster(world_size, placement, driver_timeout_s)
        yield c
        stop_cluster(c)
    return cluster
