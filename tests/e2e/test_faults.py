"""A reward function that hangs or raises, in a real run: a per-call timeout, scored 0 and
counted (reward.on_error=zero), or the run stops with the function, row and cause (fail).
The TransferQueue's process killed under a run: the run stops at once, saying so."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time

import pytest
from _run import REPO, ok, start_train, train

pytestmark = pytest.mark.slow
FAULTY = "imports=[tests.e2e._faulty_rewards]"


def test_a_hanging_reward_times_out_scores_zero_and_is_counted(tmp_path):
    out = tmp_path / "run"
    # reward beside the actor: training's reward and the evaluation's (on the rollout rank) run in
    # two processes, and the function hangs once in each
    ok(train(out, "grpo", FAULTY, "reward.name=test_hangs_once", "reward.timeout_s=1", "trainer.steps=2",
             "trainer.eval_every=0", "warmup.max_steps=5", "placement.reward_with=actor"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["reward/timeouts"] >= 1, summary
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval/accuracy"' in x]
    assert sum(e["eval/reward_timeouts"] for e in evals) >= 1, "the evaluation's reward calls are guarded too"
    assert evals[-1]["reward/timeouts"] == summary["reward/timeouts"]


def test_a_raising_reward_under_on_error_fail_stops_the_run_naming_it(tmp_path):
    p = train(tmp_path / "run", "grpo", FAULTY, "reward.name=test_raises", "reward.on_error=fail",
              "trainer.steps=2", "warmup.max_steps=5")
    assert p.returncode != 0
    assert "reward 'test_raises' failed on row 0" in p.stderr and "reward backend unavailable" in p.stderr, \
        p.stderr[-3000:]


def _descendant_running(root: int, needle: str) -> int | None:
    """The pid of a process below ``root`` whose command line contains ``needle`` (the process
    tree as perf/soak.py reads it)."""
    spec = importlib.util.spec_from_file_location("perf_soak", REPO / "perf" / "soak.py")
    soak = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(soak)  # registered first: its dataclasses look their module up
    ppids = {pid: ppid for pid, (ppid, _) in soak.proc_table().items()}
    for pid in soak.descendants(ppids, root)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    return pid
        except OSError:
            continue
    return None


def test_the_transfer_queue_process_killed_mid_run_stops_the_run_saying_so(tmp_path):
    out, err = tmp_path / "run", tmp_path / "stderr.log"
    # Every row trains (no dynamic sampling): after 5 warm-up steps every group scores all zero,
    # and a filter that drops them would leave RL without an update for a minute or two.
    p = start_train(out, "grpo", "trainer.steps=100000", "trainer.eval_every=0", "warmup.max_steps=5",
                    "algorithm.dynamic_sampling=false", stderr=err)
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").exists() and '"actor/loss"' in (out / "metrics.jsonl").read_text()):
            assert p.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)
        service = _descendant_running(p.pid, "asyncflow.transfer_queue.service_process")
        assert service is not None, "no TransferQueue service process under the run"
        os.kill(service, signal.SIGKILL)
        code = p.wait(90)  # far below the TransferQueue's 300 s timeout: the run stops on the death
    finally:
        p.kill()
        p.wait(30)
    text = err.read_text()
    assert code != 0, code
    assert f"the TransferQueue service process (pid {service}) was killed by SIGKILL" in text, text[-3000:]
