"""The TransferQueue service (controller + unit) as a child process of the driver's rank:
it serves, reports its stats, stops when asked and when its parent dies, and a start that
fails says so."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncflow.config import UnitsConfig
from asyncflow.rpc import auth
from asyncflow.single_controller.errors import LaunchError
from asyncflow.single_controller.tq_units import CONTROLLER_KEY, start_for_rank, write_unit_stats
from asyncflow.transfer_queue import TransferQueueClient, TransferQueueConfig, TransferQueueError, locality
from asyncflow.transfer_queue.service_process import ServiceProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()


@pytest.fixture(autouse=True)
def _reset_locality():
    yield
    locality.set_locality(None, None)


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_the_driver_rank_starts_the_service_in_a_child_that_serves_and_stops(tmp_path):
    store = _Store()
    tq = start_for_rank(UnitsConfig(), store, 0, 0, 0, "127.0.0.1", 5, driver=True)
    service = tq.service
    assert isinstance(service, ServiceProcess) and service.pid != os.getpid()
    assert store.kv[CONTROLLER_KEY].decode() == service.controller_address
    c = TransferQueueClient(service.controller_address, timeout=10, wait_timeout=5)
    try:
        c.create_partition("p")
        rows = [torch.arange(n) for n in (3, 0, 5)]
        meta = c.put({"ids": rows, "tag": ["a", "b", "c"]}, "p")
        got = c.get_columns(c.get_meta(["ids", "tag"], 3, "t", "p"))
        assert [got["ids"].row(i).tolist() for i in range(3)] == [r.tolist() for r in rows]
        assert got["tag"].items == ["a", "b", "c"]
        assert c.get_data(meta)["ids"][2].tolist() == [0, 1, 2, 3, 4]
        stats = asyncio.run(write_unit_stats(service.controller_address, str(tmp_path / "u.json")))
        assert [s["unit"] for s in stats] == [0]
    finally:
        c.close()
        tq.stop()
    assert not service.alive() and service._proc.returncode == 0
    tq.stop()  # idempotent


@pytest.mark.slow
def test_the_service_process_ends_when_its_parent_dies():
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from asyncflow.transfer_queue import TransferQueueConfig\n"
            "from asyncflow.transfer_queue.service_process import ServiceProcess\n"
            "s = ServiceProcess(TransferQueueConfig())\n"
            "print(s.pid, flush=True)\n"
            "import time; time.sleep(600)\n" % ROOT)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, 0.5)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 20), f"service process {child} outlived its parent"
    finally:
        parent.kill()


@pytest.mark.slow
def test_a_service_that_cannot_start_fails_saying_so_and_a_keyless_one_refuses():
    with pytest.raises(TransferQueueError, match=r"exited with code \d+ before serving"):
        ServiceProcess(TransferQueueConfig(host="256.0.0.1"), start_timeout_s=60)
    with pytest.raises(LaunchError, match="transfer_queue.service: expected one of"):
        start_for_rank(UnitsConfig(service="thread"), _Store(), 0, 0, 0, "127.0.0.1", 5, driver=True)
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "asyncflow.transfer_queue.service_process"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no run key" in p.stderr
