"""Launch paths, end to end, as a user runs them: the one-command self-launch (torch's
elastic launcher underneath) and torchrun. Rank 0 runs the driver and a worker."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_self_launch_runs_driver_on_rank0():
    p = _run(["-m", "asyncflow.single_controller.launch", "--nproc", "2", "--platform", "cpu",
              "--main", "_sc_workers:launch_demo_main"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "LAUNCH-DEMO-OK 2" in p.stdout


def test_torchrun_failing_main_exits_nonzero_with_remote_traceback():
    p = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "asyncflow.single_controller.launch", "--platform", "cpu",
              "--main", "_sc_workers:launch_failing_main"])
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "echo.fail failed on rank 0" in out and "_deep_failure" in out, out


def test_self_launch_ends_with_the_driver_s_error_after_torch_s_report():
    """The launcher's last line repeats the driver's error, which torch's report of the exiting
    ranks (its own tracebacks) would otherwise bury."""
    p = _run(["-m", "asyncflow.single_controller.launch", "--nproc", "2", "--platform", "cpu",
              "--main", "_sc_workers:launch_failing_main"])
    assert p.returncode != 0, p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncflow run failed: the driver's error: WorkerError: "), p.stderr[-3000:]
    assert "echo.fail failed on rank 0" in last, p.stderr[-3000:]


SELF_LAUNCH = ["-m", "asyncflow.single_controller.launch", "--nproc", "2"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "asyncflow.single_controller.launch"]


@pytest.mark.parametrize("launcher", [SELF_LAUNCH, TORCHRUN], ids=["self-launch", "torchrun"])
def test_rank_killed_mid_call_names_rank_role_and_method(launcher):
    """The launcher stops rank 0 (the driver) with SIGTERM as soon as rank 1 dies, before the
    driver's heartbeats notice: rank 0 still says which call it was waiting for."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, *launcher, "--platform", "cpu", "--main", "_sc_workers:launch_sleeping_main"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # its own process group: nothing outlives the test
    try:
        for line in p.stdout:  # rank 1 is inside train.sleep(60) once its pid is printed
            if line.startswith("RANK1-PID"):
                break
        else:
            raise AssertionError(f"the run ended (exit {p.wait()}) before its call:\n{p.stderr.read()[-4000:]}")
        time.sleep(0.3)
        os.kill(int(line.split()[1]), signal.SIGKILL)
        _, err = p.communicate(timeout=30)  # far below the 60 s sleep: the run stops on the death
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0, err
    assert "while waiting for: rank 1 (role train) train.sleep, running" in err, err[-4000:]  # rank 0's line
    if launcher is SELF_LAUNCH:  # launch_local's line: which rank died (torchrun prints its own table)
        assert "rank 1 was killed by SIGKILL" in err, err[-4000:]
