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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS, N = 4, 4  # TINY's prompts_per_step and rollout.n
# RL until the test writes the stop file, some steps after the new process is back (it takes
# tens of seconds to start on a loaded machine); the budget only bounds a run that never gets there.
AFTER_BACK_STEPS = 10
FAULT_RUN = ["grpo", "trainer.nproc=3", "placement.mode=disaggregated", "placement.actor_ranks=[0]",
             "placement.rollout_ranks=[1,2]", "placement.reward_with=actor", "fault.rollout_restarts=true",
             "fault.backoff_s=0.5", "trainer.eval_every=0", "warmup.max_steps=5", "algorithm.dynamic_sampling=false",
             "trainer.steps=100000", "trainer.time_budget_s=300", "trainer.stop_file=STOP",
             "imports=[tests.e2e._instance_dies]"]
BACK = "rollout instance 1 (rank 2) is back (restart 1)"


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


def _finish(p, err: Path, timeout: float = 400, expect: int = 0) -> str:
    try:
        code = p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    text = err.read_text()
    assert (code == 0) == (expect == 0), f"exit {code}:\n{text[-6000:]}"
    return text


def _check_audit(out: Path) -> dict:
    """Every prompt of the run trained once, in one step, its group whole; the summary's count."""
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    per_uid = Counter(r["uid"] for r in rows)
    steps_of = {}
    for r in rows:
        steps_of.setdefault(r["uid"], set()).add(r["step"])
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(per_uid) == list(range(summary["rl_steps"] * PROMPTS)), sorted(per_uid)
    assert set(per_uid.values()) == {N}, {u: c for u, c in per_uid.items() if c != N}
    assert all(len(s) == 1 for s in steps_of.values()), {u: s for u, s in steps_of.items() if len(s) > 1}
    return summary


def _lost_and_back(out: Path, err: Path, kill, *extra: str) -> dict:
    p = start_train(out, *FAULT_RUN, *extra, stderr=err)
    try:
        _wait_for(p, err, "a trained step", lambda: _trained_steps(out) >= 1)
        if kill is not None:
            kill(_instance_pid(out, "rollout1"))
        _wait_for(p, err, "the new process", lambda: BACK in err.read_text(errors="replace"))
        back_at = _trained_steps(out)
        _wait_for(p, err, f"{AFTER_BACK_STEPS} steps after the new process was back",
                  lambda: _trained_steps(out) >= back_at + AFTER_BACK_STEPS)
        (out / "STOP").write_text("")
    except BaseException:
        p.kill()
        p.wait(30)
        raise
    text = _finish(p, err)
    assert BACK in text, text[-4000:]
    summary = _check_audit(out)
    faults = summary["faults"]
    assert faults["failures"] >= 1 and faults["restarts"] >= 1, faults
    assert faults["instances"][1]["restarts"] >= 1 and faults["instances"][0]["failures"] == 0, faults
    served = summary["rollout_instances"][1]["rows_written"]  # counted by its new process alone
    assert served > 0, "the restarted instance served no rows"
    return summary


def test_a_killed_instance_with_the_reward_beside_it_is_replaced_and_every_row_is_scored_once(tmp_path):
    """SIGKILL mid-run, with placement.reward_with=rollout (GRPO's own placement): one reward
    worker per rollout rank; the killed process took its reward worker with it, its rows in
    flight are generated again, the rows of a reward share it had not written are scored on the
    other rank, and the new process serves both roles again. (The reward on the actor, the
    other placement, is what the hung and the mid-sync losses below run with.)"""
    out = tmp_path / "run"
    summary = _lost_and_back(out, tmp_path / "stderr.log", lambda pid: os.kill(pid, signal.SIGKILL),
                             "placement.reward_with=rollout")
    roles = {w["rank"]: set(w["roles"]) for w in json.loads((out / "ranks.json").read_text())}
    assert {"rollout1", "reward"} <= roles[2] and {"rollout0", "reward"} <= roles[1], roles
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(r.get("score"), float) for r in rows), [r for r in rows if "score" not in r][:3]
    assert "rows_recomputed" in summary["faults"], summary["faults"]  # a share in flight when killed, or none


def test_an_instance_dying_while_it_scores_has_its_reward_share_scored_on_the_other(tmp_path, monkeypatch):
    """Rank 2 dies inside a reward call: none of that share's scores were written, so all of
    them are computed on rank 1 (faults.rows_recomputed), and every row trains once, scored."""
    monkeypatch.setenv("ASYNCFLOW_TEST_INSTANCE_DIES", "in_reward")
    out = tmp_path / "run"
    summary = _lost_and_back(out, tmp_path / "stderr.log", None, "placement.reward_with=rollout")
    assert "exited with code 9" in summary["faults"]["instances"][1]["last_error"], summary["faults"]
    assert summary["faults"]["rows_recomputed"] > 0, summary["faults"]
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(r.get("score"), float) for r in rows), [r for r in rows if "score" not in r][:3]


def test_a_hung_rollout_instance_is_replaced_and_every_prompt_trains_once(tmp_path):
    """SIGSTOP: the process lives but answers nothing; the driver's heartbeats find it, it is
    killed (no late row may come from it) and replaced."""
    summary = _lost_and_back(tmp_path / "run", tmp_path / "stderr.log", lambda pid: os.kill(pid, signal.SIGSTOP))
    assert "stopped answering heartbeats" in summary["faults"]["instances"][1]["last_error"]


def test_an_instance_dying_in_a_weight_sync_is_replaced_and_the_version_reaches_the_others(tmp_path, monkeypatch):
    """It dies with a version half received (several buckets: some in, the rest on the wire):
    the version is sent again to the instance still serving, over groups made without it."""
    monkeypatch.setenv("ASYNCFLOW_TEST_INSTANCE_DIES", "in_sync")
    err = tmp_path / "stderr.log"
    summary = _lost_and_back(tmp_path / "run", err, None, "weight_sync.bucket_mb=0.25")
    assert "exited with code 9" in summary["faults"]["instances"][1]["last_error"], summary["faults"]
    assert "a rollout instance was lost meanwhile; sending it again to the others" in err.read_text()


def test_an_instance_that_keeps_dying_stops_the_run_after_its_restart_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCFLOW_TEST_INSTANCE_DIES", "always")
    out, err = tmp_path / "run", tmp_path / "stderr.log"
    p = start_train(out, *FAULT_RUN, "fault.max_restarts_per_instance=1", "trainer.save_every=2", stderr=err)
    text = _finish(p, err, expect=1)
    assert "InstanceGaveUp: rollout instance 1 (rollout1, rank 2) was lost 2 times" in text, text[-4000:]
    assert "its restart 1 failed" in text, text[-4000:]  # the new process died as it started
    assert "fault.max_restarts_per_instance=1" in text and "its process exited with code 9" in text, text[-4000:]
    assert "trainer.resume=auto" in text, text[-2000:]  # the command that goes on from the last checkpoint
