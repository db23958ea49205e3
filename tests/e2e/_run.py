"""Running `asyncflow train` as a user does, in a subprocess, for the end-to-end tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A few seconds of warm-up, so that responses are digits and a partial-credit reward varies.
TINY = ["trainer.time_budget_s=0", "trainer.prompts_per_step=4", "rollout.n=4", "rollout.batch_prompts=2",
        "data.num_eval=16", "warmup.max_steps=10", "warmup.check_every=5", "warmup.batch_size=32",
        "warmup.target_accuracy=1.0", "trainer.progress=false"]


def _command(out: Path, args: tuple[str, ...], tiny: bool = True) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    shrink = TINY if tiny else ["trainer.progress=false"]
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", *args[:1], *shrink, *args[1:], f"trainer.out_dir={out}"]
    return cmd, env


def train(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd, env = _command(out, args)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def train_as_is(out: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The job's own settings (warm-up, batch, evaluation set), only ``args`` changed: for the
    tests that it learns."""
    cmd, env = _command(out, args, tiny=False)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def start_train(out: Path, *args: str, stderr: Path) -> subprocess.Popen:
    """The same run, not waited for; its stderr goes to a file (a pipe nobody reads would fill)."""
    cmd, env = _command(out, args)
    with open(stderr, "wb") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-8000:]}"
