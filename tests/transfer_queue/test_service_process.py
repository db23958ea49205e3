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

from asyncflow.rpc import auth
from asyncflow.single_controller.errors import LaunchError
from asyncflow.single_controller.tq_units import CONTROLLER_KEY, TransferQueueLayout, start_for_rank, write_unit_stats
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
    """Ended: no such process, or a zombie nobody reaped yet (an orphan's reaper may be slow)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.both_stacks
def test_the_driver_rank_starts_the_service_in_a_child_that_serves_and_stops(tmp_path):
    store = _Store()
    tq = start_for_rank(TransferQueueLayout(), store, 0, 0, 0, "127.0.0.1", 5, driver=True)
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
    code = (f"import sys; sys.path.insert(0, {ROOT!r})\n"
            "from asyncflow.transfer_queue import TransferQueueConfig\n"
            "from asyncflow.transfer_queue.service_process import ServiceProcess\n"
            "s = ServiceProcess(TransferQueueConfig())\n"
            "print(s.pid, flush=True)\n"
            "import time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, 0.5)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 20), f"service process {child} outlived its parent"
    finally:
        parent.kill()
        if child is not None and not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_service_that_cannot_start_fails_saying_so_and_a_keyless_one_refuses():
    with pytest.raises(TransferQueueError, match=r"exited with code \d+ before serving"):
        ServiceProcess(TransferQueueConfig(host="256.0.0.1"), start_timeout_s=60)
    with pytest.raises(LaunchError, match="transfer_queue.service: expected one of"):
        start_for_rank(TransferQueueLayout(service="thread"), _Store(), 0, 0, 0, "127.0.0.1", 5, driver=True)
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "asyncflow.transfer_queue.service_process"], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no run key" in p.stderr
    with pytest.raises(TransferQueueError, match=r"exited with code 1 before serving"):
        ServiceProcess(TransferQueueConfig(), imports=["asyncflow_no_such_module"])


@pytest.mark.slow
def test_the_service_imports_the_runs_modules_and_a_death_under_the_run_is_reported(tmp_path, monkeypatch):
    (tmp_path / "my_samplers.py").write_text(
        "from asyncflow.transfer_queue import register_sampler\n"
        "from asyncflow.transfer_queue.samplers import SequentialSampler\n"
        "register_sampler('mine', SequentialSampler)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    deaths: list[str] = []
    service = ServiceProcess(TransferQueueConfig(wait_timeout_s=5), imports=["my_samplers"], on_death=deaths.append)
    c = TransferQueueClient(service.controller_address, timeout=10, wait_timeout=5)
    try:
        c.create_partition("p")
        c.put({"k": torch.arange(4)}, "p")
        assert len(c.get_meta(["k"], 2, "t", "p", sampler="mine", timeout=2).rows) == 2  # known there
        with pytest.raises(ValueError, match=r"unknown sampler 'theirs'.*module of the run's `imports`"):
            c.get_meta(["k"], 2, "t", "p", sampler="theirs", timeout=2)
        assert deaths == []
        os.kill(service.pid, signal.SIGKILL)  # as the out-of-memory killer would
        deadline = time.monotonic() + 20
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(deaths) == 1 and "was killed by SIGKILL" in deaths[0] and "every row it held" in deaths[0]
    finally:
        c.close()
        service.stop_in_thread()
    assert len(deaths) == 1  # a stop that was asked for is no death


def test_the_service_can_stay_in_the_driver_ranks_threads():
    tq = start_for_rank(TransferQueueLayout(service="driver"), _Store(), 0, 0, 0, "127.0.0.1", 5, driver=True)
    try:
        assert not isinstance(tq.service, ServiceProcess) and tq.service.controller is not None
    finally:
        tq.stop()
