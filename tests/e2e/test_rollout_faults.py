"""A rollout instance lost under a real run (fault.rollout_restarts): 1 training rank and 2
rollout instances, async. The instance's process is killed (SIGKILL), hangs (SIGSTOP) or
dies while a version is on the wire; the run finishes its steps, the per-row audit
(samples.jsonl) shows every prompt trained exactly once with its group whole, and the new
process served rows. An instance that keeps dying stops the run after its restart budget,
naming the instance and its last error."""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from _run import start_train

pytestmark = pytest.mark.slow
STEPS, PROMPTS, N = 20, 4, 4  # TINY's prompts_per_step and rollout.n
FAULT_RUN = ["grpo", "trainer.nproc=3", "placement.mode=disaggregated", "placement.actor_ranks=[0]",
             "placement.rollout_ranks=[1,2]", "placement.reward_with=actor", "fault.rollout_restarts=true",
             "fault.backoff_s=0.5", "trainer.eval_every=0", "warmup.max_steps=5", "algorithm.dynamic_sampling=false",
             f"trainer.steps={STEPS}"]


def _trained_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"actor/loss"' in line and '"phase"' not in line for line in path.read_text().splitlines())


def _wait_for(p, err: Path, what: str, cond, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, f"the run ended ({p.returncode}) before {what}:\n{err.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{err.read_text()[-4000:]}"
        time.sleep(0.2)


def _instance_pid(out: Path, role: str) -> int:
    for w in json.loads((out / "ranks.json").read_text()):
        if role in w["roles"]:
            return int(w["pid"])
    raise AssertionError(f"no rank runs {role}: {(out / 'ranks.json').read_text()}")


def _finish(p, err: Path, timeout: float = 400) -> str:
    try:
        code = p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    text = err.read_text()
    assert code == 0, f"exit {code}:\n{text[-6000:]}"
    return text


def _check_audit(out: Path) -> dict:
    """Every prompt of the run trained once, in one step, its group whole; the summary's count."""
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    per_uid = Counter(r["uid"] for r in rows)
    steps_of = {}
    for r in rows:
        steps_of.setdefault(r["uid"], set()).add(r["step"])
    assert sorted(per_uid) == list(range(STEPS * PROMPTS)), sorted(per_uid)
    assert set(per_uid.values()) == {N}, {u: c for u, c in per_uid.items() if c != N}
    assert all(len(s) == 1 for s in steps_of.values()), {u: s for u, s in steps_of.items() if len(s) > 1}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS
    return summary


def _lost_and_back(out: Path, err: Path, kill, *extra: str) -> dict:
    p = start_train(out, *FAULT_RUN, *extra, stderr=err)
    try:
        _wait_for(p, err, "a trained step", lambda: _trained_steps(out) >= 1)
        pid = _instance_pid(out, "rollout1")
        kill(pid)
    except BaseException:
        p.kill()
        p.wait(30)
        raise
    _finish(p, err)
    summary = _check_audit(out)
    faults = summary["faults"]
    assert faults["failures"] >= 1 and faults["restarts"] >= 1, faults
    assert faults["instances"][1]["restarts"] >= 1 and faults["instances"][0]["failures"] == 0, faults
    served = summary["rollout_instances"][1]["rows_written"]  # counted by its new process alone
    assert served > 0, "the restarted instance served no rows"
    return summary


def test_a_killed_rollout_instance_is_replaced_and_every_prompt_trains_once(tmp_path):
    _lost_and_back(tmp_path / "run", tmp_path / "stderr.log", lambda pid: os.kill(pid, signal.SIGKILL))
