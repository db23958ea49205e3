"""`torchrun ... -m asyncflow.cli train` as users launch it: one node with 2 ranks, and two
"nodes" (two torchrun invocations, --nnodes 2 over loopback) with one rank each."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from _run import REPO, TINY

STEPS = ["trainer.steps=2", "reward.name=digits", "trainer.eval_every=0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _check(out, procs) -> None:
    for p in procs:
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["nproc"] == 2


@pytest.mark.slow
def test_torchrun_one_node(tmp_path):
    out = tmp_path / "run"
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "asyncflow.cli", "train", "grpo", *TINY,
                    *STEPS, f"trainer.out_dir={out}")
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    _check(out, [p])


def _two_nodes(out, *extra: str, rdzv_endpoint: bool = False) -> list[subprocess.CompletedProcess]:
    """``rdzv_endpoint``: README's form (``--rdzv-endpoint HOST:PORT``), else the launch
    scripts' (``--master-addr HOST --master-port PORT``)."""
    port = _port()
    where = ["--rdzv-endpoint", f"127.0.0.1:{port}"] if rdzv_endpoint else \
        ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = []
    for node in (0, 1):
        cmd = _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                        *where, "-m", "asyncflow.cli", "train",
                        "grpo", *TINY, *STEPS, f"trainer.out_dir={out}", *extra)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:  # one node failed or hung: do not leave the other behind
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return done


@pytest.mark.slow
@pytest.mark.both_stacks
def test_torchrun_two_nodes_over_loopback(tmp_path):
    out = tmp_path / "run"
    _check(out, _two_nodes(out, rdzv_endpoint=True))
    units = json.loads((out / "tq_units.json").read_text())
    assert [u["unit"] for u in units] == [0]  # the default: one unit, in the driver's process
    assert set(units[0]["put_rows_by_node"]) == {"0", "1"}  # both nodes wrote into it


@pytest.mark.slow
def test_torchrun_two_nodes_one_storage_unit_per_node(tmp_path):
    """Async GRPO over two "nodes", one TransferQueue unit each: the driver (node 0) creates
    the prompt rows in node 0's unit; the rollout (rank 1, node 1) writes its responses into
    node 1's unit; the actor on node 0 reads from both."""
    out = tmp_path / "run"
    _check(out, _two_nodes(out, "transfer_queue.storage_units=per_node", "workflow.mode=async"))
    units = {u["unit"]: u for u in json.loads((out / "tq_units.json").read_text())}
    assert sorted(units) == [0, 1], units
    # Each unit holds only what producers on its own node wrote, and both got some.
    assert set(units[0]["put_rows_by_node"]) == {"0"} and units[0]["put_rows_by_node"]["0"] > 0, units
    assert set(units[1]["put_rows_by_node"]) == {"1"} and units[1]["put_rows_by_node"]["1"] > 0, units
    assert units[1]["put_bytes_by_node"]["1"] > 0
