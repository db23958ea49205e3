"""Failures: a worker killed mid-call is reported within 10 s naming its rank and role;
workers exit when the driver's heartbeat stops, or when the process that started them
dies before any driver pinged (no orphans)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _sc_workers as W
import pytest
from _sc_cluster import start_cluster, stop_cluster

from asyncflow.single_controller import RolePlacement, WorkerDiedError

pytestmark = pytest.mark.slow


def test_worker_killed_mid_call_is_reported_fast():
    placement = RolePlacement("disaggregated", roles={"gen": [0], "train": [1]})
    c = start_cluster(2, placement)
    try:
        d = c.driver

        async def go():
            gen = await d.create_group(W.EchoWorker, "gen")
            train = await d.create_group(W.EchoWorker, "train")
            assert (gen.ranks, train.ranks) == ([0], [1])
            call = asyncio.ensure_future(train.sleep(60.0))
            other = asyncio.ensure_future(d.run(gen.sleep(60.0)))  # the run stops too, not only the call
            await asyncio.sleep(0.5)
            c.workers.kill(1)
            return await asyncio.gather(call, other, return_exceptions=True)
        # Both calls sleep 60 s: ending within the 30 s limit here, with these errors, is the
        # death being noticed, not the calls ending.
        err_call, err_run = c.run(go(), timeout=30)
        for err in (err_call, err_run):
            assert isinstance(err, WorkerDiedError), repr(err)
            assert "rank 1" in str(err) and "train" in str(err)
        assert "train.sleep on rank 1" in str(err_call)
        # The run awaited rank 0; its error still says what the dead rank was running.
        assert "it was running rank 1 (role train) train.sleep" in str(err_run), str(err_run)
        assert err_run.method == "train.sleep"
        with pytest.raises(WorkerDiedError):
            d.check()
    finally:
        stop_cluster(c)
    assert c.workers.join(0) == [4, -9]  # rank 0 told to exit at once (it was mid-call); rank 1 SIGKILLed


def test_workers_exit_when_driver_heartbeat_stops():
    c = start_cluster(2, driver_timeout_s=2.0)
    try:
        c.run(c.driver.stop_heartbeats())  # pings stop without a shutdown, as when the driver process dies
        codes = c.workers.join(15)
        assert codes == [3, 3], codes  # 3: how a worker exits once its driver falls silent
    finally:
        stop_cluster(c)


# The pids go through a file: the workers share the starter's stdout, and torch 2.10's gloo
# prints there from several processes at once, so a line on stdout may be interleaved.
_ORPHANS = """
import os, sys, time
from asyncflow.single_controller.local import LocalWorkers
from _sc_cluster import run_config
w = LocalWorkers(2, run_config())
out = sys.argv[1]
with open(out + ".tmp", "w") as f:
    f.write(" ".join(str(p.pid) for p in w.procs))
os.replace(out + ".tmp", out)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: whoever reaps orphans here may not be quick about it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_exit_when_their_starter_dies_before_any_ping(tmp_path: Path):
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)]), "OMP_NUM_THREADS": "1"}
    pid_file = tmp_path / "pids"
    p = subprocess.Popen([sys.executable, "-c", _ORPHANS, str(pid_file)], env=env, stdout=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        t0 = time.monotonic()
        while not pid_file.exists() and p.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert pid_file.exists(), f"LocalWorkers did not start within 60 s (exit {p.poll()})"
        pids = [int(x) for x in pid_file.read_text().split()]
        assert len(pids) == 2, f"expected 2 worker pids, got {pids}"
        p.kill()  # SIGKILL: no atexit, no close(); the workers have never been pinged
        p.wait()
        t0 = time.monotonic()
        while not all(_gone(q) for q in pids) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert all(_gone(q) for q in pids), f"workers {pids} outlived their starter by 10 s"
    finally:
        p.kill()
        p.wait()
        for q in pids:
            if not _gone(q):
                os.kill(q, signal.SIGKILL)
