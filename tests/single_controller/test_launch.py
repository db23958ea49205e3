"""Launch paths, end to end, as a user runs them: the one-command self-launch (torch's
elastic launcher underneath) and torchrun. Rank 0 runs the driver and a worker."""
from __future__ import annotations

import os
import subprocess
import sys
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
