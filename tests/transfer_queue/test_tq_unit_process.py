"""A storage unit started as its own process from the command line (one per node)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from asyncflow.transfer_queue import TransferQueueClient
from asyncflow.transfer_queue.meta import unit_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_unit_process_registers_and_serves_puts_and_gets(tq):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.transfer_queue.unit_process",
                             "--controller", tq.address, "--index", "1", "--host", "127.0.0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while tq.client.status()["units"] < 2:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the unit process did not register within 60 s"
            time.sleep(0.1)
        node1 = TransferQueueClient(tq.address, timeout=20, wait_timeout=5, preferred_unit=1)
        try:
            node1.create_partition("p")
            rows = [torch.arange(n) for n in (3, 0, 5)]
            meta = node1.put({"ids": rows, "tag": ["a", "b", "c"]}, "p")
            assert all(unit_of(r) == 1 for r in meta.rows)  # stored on the unit of "node 1"
            got = tq.client.get_columns(tq.client.get_meta(["ids", "tag"], 3, "t", "p"))
            assert [got["ids"].row(i).tolist() for i in range(3)] == [r.tolist() for r in rows]
            assert got["tag"].items == ["a", "b", "c"]
            assert tq.client.clear("p") == 3
        finally:
            node1.close()
    finally:
        proc.kill()
        proc.wait(10)
