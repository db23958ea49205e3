"""Crash and resume, end to end: runs killed with SIGKILL (the whole run, or one worker),
a checkpoint write that the OS refuses, and `trainer.resume=auto` afterwards."""
from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _run import REPO, TINY, ok, train

pytestmark = pytest.mark.slow
RUN = ["reward.name=digits", "trainer.eval_every=0", "algorithm.dynamic_sampling=false", "trainer.save_every=1"]


def _start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *TINY, *args, f"trainer.out_dir={out}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: killed as a whole


def _wait_for_checkpoint(p: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
    state = out / "checkpoints" / f"step_{step}" / "state.json"
    deadline = time.monotonic() + timeout
    while not state.exists():
        if p.poll() is not None:
            _, err = p.communicate()
            raise AssertionError(f"the run ended (exit {p.returncode}) before checkpoint {step}:\n{err[-4000:]}")
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout} s"
        time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_pid(out: Path, rank: int) -> int:
    """The pid of ``rank``, from the ranks.json the trainer writes once its groups exist."""
    for w in json.loads((out / "ranks.json").read_text()):
        if w["rank"] == rank:
            return int(w["pid"])
    raise AssertionError(f"rank {rank} is not in {out / 'ranks.json'}")


def _digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(out / "hf_model" / "model.safetensors")


def _samples(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def test_sync_run_killed_at_random_then_resumed_ends_with_the_same_weights(tmp_path):
    args = [*RUN, "trainer.steps=5", "workflow.mode=sync", "trainer.keep_checkpoints=5"]
    ok(train(tmp_path / "straight", "grpo", *args))

    out = tmp_path / "crashed"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    p = _start(out, *args)
    try:
        _wait_for_checkpoint(p, out, rng.randint(1, 3))
        time.sleep(rng.uniform(0.0, 0.4))
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.communicate()
    time.sleep(0.5)
    assert not [q for q in _descendants(1) if q == p.pid], "the killed run left processes behind"
    r = train(out, "grpo", *args, "trainer.resume=auto")
    ok(r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 5 and summary["resumed_at_step"] >= 1, (seed, summary)
    assert summary["resume_config_changes"] == [], summary  # the same command, plus trainer.resume=auto

    a, b = _weights(tmp_path / "straight"), _weights(out)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff < 1e-5, f"kill seed {seed}: resumed weights differ from the uninterrupted run by {diff}"
    key = lambda s: (s["step"], s["uid"], s["seed"], tuple(s["response_ids"]))  # noqa: E731
    assert sorted(map(key, _samples(out))) == sorted(map(key, _samples(tmp_path / "straight"))), seed
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl_steps = [m["step"] for m in metrics if "actor/grad_norm" in m]
    assert rl_steps == [1, 2, 3, 4, 5], f"metrics.jsonl has steps {rl_steps}: each RL step once, in order"
    assert any(abs(m["actor/grad_norm"]) > 0 for m in metrics if "actor/grad_norm" in m), "weak test: no update"


def _full_disk():
    """Any file this process writes stops at 64 KiB (EFBIG), as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_async_worker_killed_then_disk_full_then_resumed_loses_no_prompt(tmp_path):
    out = tmp_path / "run"
    steps, prompts_per_step, n = 6, 4, 4  # TINY: 4 prompts per step, 4 responses each
    args = [*RUN, f"trainer.steps={steps}", "workflow.mode=async", "trainer.keep_checkpoints=2"]

    # 1. SIGKILL the rollout worker (rank 1) once two steps are checkpointed.
    p = _start(out, *args)
    try:
        _wait_for_checkpoint(p, out, 2)
        os.kill(_rank_pid(out, 1), signal.SIGKILL)
        _, err = p.communicate(timeout=60)  # a run left waiting for the dead worker fails here
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0
    assert "rank 1" in err and "rollout" in err, err[-3000:]
    # Rank 0 (the driver), stopped by the launcher, names the calls it was waiting for; which
    # ones varies with the moment of the kill (generate, receive_weights, a checkpoint, none).
    assert "asyncflow: stopped by the launcher (SIGTERM; another rank probably died) while waiting for: " \
        in err, err[-3000:]
    newest = sorted((out / "checkpoints").glob("step_*"), key=lambda d: int(d.name[5:]))[-1]
    state = json.loads((newest / "state.json").read_text())
    assert state["in_flight"], "async: the next step's prompts are in flight at every checkpoint"
    before = _digest(newest)

    # 2. Resume on a "full disk": the first new checkpoint fails; the one resumed from is untouched.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *TINY, *args, f"trainer.out_dir={out}",
           "trainer.resume=auto"]
    full = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, preexec_fn=_full_disk)
    assert full.returncode != 0, full.stdout[-2000:]
    assert "writing the checkpoint after RL step" in full.stderr and "is untouched" in full.stderr, full.stderr[-4000:]
    assert _digest(newest) == before, "a failed checkpoint write changed the previous checkpoint"
    assert not list((out / "checkpoints").glob(".*.tmp")), "a failed write left its temporary directory"

    # 3. Resume for real: every prompt trained exactly once across the crashes.
    r = train(out, "grpo", *args, "trainer.resume=auto")
    ok(r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == steps and summary["regenerated_prompts"] == len(state["in_flight"]), summary
    assert "issued again" in r.stderr
    rows = _samples(out)
    per_uid: dict[int, list] = {}
    for s in rows:
        per_uid.setdefault(s["uid"], []).append((s["step"], s["seed"]))
    assert sorted(per_uid) == list(range(steps * prompts_per_step)), "a prompt was lost or an extra one trained"
    for uid, group in per_uid.items():
        assert len(group) == n and len({seed for _, seed in group}) == n, f"prompt {uid} trained as {group}"
        assert len({step for step, _ in group}) == 1, f"prompt {uid} trained in two steps: {group}"


def test_ctrl_c_stops_every_rank_exits_130_and_prints_the_command_that_resumes(tmp_path):
    """Ctrl-C reaches the launcher and every rank (the terminal signals the process group): the
    run ends in seconds with exit code 130 and no crash report, leaves no process behind, and
    the command it prints goes on from its newest checkpoint."""
    import shlex
    out = tmp_path / "run"
    args = [*RUN, "trainer.steps=400", "workflow.mode=async"]
    p = _start(out, *args)
    try:
        _wait_for_checkpoint(p, out, 2)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 130, err[-4000:]
    assert "asyncflow run interrupted: this launcher got SIGINT" in err, err[-4000:]
    assert "Fatal Python error" not in err and "Traceback" not in err, err[-8000:]
    assert "leaked semaphore" not in err, err[-2000:]  # no process lock left behind by a rank's progress bars
    time.sleep(0.5)
    assert not _descendants(p.pid), "the interrupted run left processes behind"
    hint = next(line for line in err.splitlines() if "to go on from it: " in line)
    cmd = shlex.split(hint.split("to go on from it: ", 1)[1])
    assert cmd[:3] == ["asyncflow", "train", "grpo"] and cmd[-1] == "trainer.resume=auto", hint
    resumed = subprocess.run([sys.executable, "-m", "asyncflow.cli", *cmd[1:], "trainer.steps=4", "optim.lr=0.002"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                             capture_output=True, text=True, timeout=240)
    ok(resumed)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_at_step"] >= 2
    # A setting changed on resume is allowed and reported (trainer.steps, the run's length, is not).
    assert [c.split(":")[0] for c in summary["resume_config_changes"]] == ["optim.lr"], summary
    assert "resuming with 1 settings other than" in resumed.stderr
