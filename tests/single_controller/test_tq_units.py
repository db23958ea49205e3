"""Storage units per node (transfer_queue.storage_units=per_node): which rank hosts one,
its registration and clean stop, and the errors that name a missing or silent unit."""
from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from asyncflow.single_controller.errors import LaunchError
from asyncflow.single_controller.tq_units import (
    CONTROLLER_KEY,
    NodeUnit,
    TransferQueueLayout,
    nodes_of_ranks,
    start_for_rank,
    wait_for_node_units,
    write_unit_stats,
)
from asyncflow.transfer_queue import (
    TransferQueueClient,
    TransferQueueConfig,
    TransferQueueService,
    TransferQueueTimeout,
    locality,
)


class _Store:
    """The few TCPStore calls used here, in memory."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key]


@pytest.fixture
def service():
    svc = TransferQueueService(TransferQueueConfig(wait_timeout_s=5)).start_in_thread()
    yield svc
    svc.stop_in_thread()


@pytest.fixture(autouse=True)
def _reset_locality():
    yield
    locality.set_locality(None, None)


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_only_local_rank_0_of_other_nodes_hosts_a_unit(service):
    store = _Store()
    store.set(CONTROLLER_KEY, service.controller_address)
    cfg = TransferQueueLayout(storage_units="per_node")
    others = [start_for_rank(cfg, store, rank, local, node, "127.0.0.1", 5, driver=False)
              for rank, local, node in [(1, 1, 0), (3, 1, 1)]]
    assert all(t.unit is None for t in others)
    assert locality.local_node() == 1 and locality.local_unit() == 1  # rank 3 writes to node 1's unit
    host = start_for_rank(cfg, store, 2, 0, 1, "127.0.0.1", 5, driver=False)
    try:
        assert host.unit is not None and host.unit.index == 1
        store.set("asyncflow/node/0", "0")
        assert nodes_of_ranks(store, 4) == [0, 0, 1, 1]
        asyncio.run(wait_for_node_units(service.controller_address, [0, 0, 1, 1], 5))
    finally:
        host.stop()
    # The default keeps one unit: nobody else hosts one, and writers spread nothing.
    assert start_for_rank(TransferQueueLayout(), store, 2, 0, 1, "127.0.0.1", 5, driver=False).unit is None
    assert locality.local_unit() is None and locality.local_node() == 1


def test_the_driver_must_be_on_node_0_and_the_storage_units_value_is_checked():
    with pytest.raises(LaunchError, match="must be on node 0"):
        start_for_rank(TransferQueueLayout(storage_units="per_node"), _Store(), 0, 0, 1, "127.0.0.1", 5, driver=True)
    with pytest.raises(LaunchError, match="storage_units"):
        start_for_rank(TransferQueueLayout(storage_units="everywhere"), _Store(), 0, 0, 0, "127.0.0.1", 5, driver=True)


def test_a_node_without_the_controller_address_fails_naming_it():
    with pytest.raises(LaunchError, match=r"rank 2 \(node 1\).*controller's address did not appear"):
        start_for_rank(TransferQueueLayout(storage_units="per_node"), _Store(), 2, 0, 1, "127.0.0.1", 0.3, driver=False)


def test_a_unit_that_cannot_register_fails_within_its_timeout():
    cfg = TransferQueueLayout(storage_units="per_node", register_timeout_s=1.0)
    with pytest.raises(LaunchError, match="storage unit 3 \\(node 3\\) did not register"):
        NodeUnit(_dead_address(), 3, "127.0.0.1", cfg)


def test_the_driver_names_nodes_whose_unit_is_missing(service):
    with pytest.raises(LaunchError, match=r"nodes \[1, 2\] did not register.*\{1: \[2, 3\], 2: \[4\]\}"):
        asyncio.run(wait_for_node_units(service.controller_address, [0, 0, 1, 1, 2], 0.3))


def test_node_unit_serves_writes_stops_cleanly_and_is_then_named_by_readers(service, tmp_path):
    unit = NodeUnit(service.controller_address, 1, "127.0.0.1", TransferQueueLayout(storage_units="per_node"))
    c = TransferQueueClient(service.controller_address, timeout=1.0, wait_timeout=2.0, preferred_unit=1, node=1)
    try:
        c.create_partition("p")
        meta = c.put({"x": torch.arange(4)}, "p")
        assert c.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
        stats = asyncio.run(write_unit_stats(service.controller_address, str(tmp_path / "u.json")))
        assert {s["unit"]: s["put_rows_by_node"] for s in stats} == {0: {}, 1: {"1": 4}}
        assert (tmp_path / "u.json").exists()
        unit.stop()
        with pytest.raises(TransferQueueTimeout, match=r"storage unit 1 \(tcp://"):
            c.get_data(meta)
    finally:
        unit.stop()
        c.close()
