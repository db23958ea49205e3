"""bench_e2e --fault's pure parts: when a kill is due, which process is the victim, the RL
seconds to each accuracy, and the killer against a run directory written step by step."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from _fault_bench import Killer, kills_due, seconds_to, trained_steps, victim_pid


def test_kills_fall_every_n_steps_and_never_twice_for_one():
    assert [kills_due(s, 3, 0) for s in range(5)] == [False, False, False, True, True]
    assert not kills_due(5, 3, 1) and kills_due(6, 3, 1) and not kills_due(100, 0, 0)
    # the replacement seen joined at step 6: the next kill waits half of N steps after it
    assert not kills_due(6, 4, 1, joined_at=6) and not kills_due(7, 4, 1, joined_at=6) and kills_due(8, 4, 1, 6)


def test_the_victim_and_the_trained_steps_are_read_from_the_run_files():
    ranks = json.dumps([{"rank": 1, "pid": 11, "roles": ["rollout0"]}, {"rank": 2, "pid": 22, "roles": ["rollout1"]}])
    assert victim_pid(ranks) == 22 and victim_pid(ranks, "rollout7") is None
    text = "\n".join([json.dumps({"phase": "sft", "actor/loss": 1}), json.dumps({"step": 1, "actor/loss": 0.1}),
                      json.dumps({"step": 2, "actor/loss": 0.2})])
    assert trained_steps(text) == 2


def test_seconds_to_accuracy_start_at_the_evaluation_before_rl():
    metrics = [{"phase": "before_rl", "time_s": 10.0, "eval/accuracy": 0.1},
               {"phase": "rl", "time_s": 15.0, "eval/accuracy": 0.35},
               {"phase": "rl", "time_s": 20.0, "eval/accuracy": 0.3},
               {"phase": "after_rl", "time_s": 30.0, "eval/accuracy": 0.55}]
    assert seconds_to(metrics, [0.3, 0.5, 0.9]) == {"0.3": 5.0, "0.5": 20.0, "0.9": None}


def test_the_killer_waits_for_the_replacement_before_the_next_kill(tmp_path):
    killed = []
    k = Killer(tmp_path, every=2, poll_s=0.01, kill=killed.append).start()

    def write(steps, pid):
        # Each file replaced whole, as a run grows them: a killer polling meanwhile never reads one
        # truncated (an empty metrics file read beside the new pid would count it joined at step 0).
        for name, text in (("metrics.jsonl", "\n".join(json.dumps({"step": i, "actor/loss": 0}) for i in range(steps))),
                           ("ranks.json", json.dumps([{"rank": 2, "pid": pid, "roles": ["rollout1"]}]))):
            (tmp_path / f"{name}.tmp").write_text(text)
            os.replace(tmp_path / f"{name}.tmp", tmp_path / name)

    def settle(n):
        deadline = time.monotonic() + 10
        while len(killed) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    write(1, 100)
    write(2, 100)
    settle(1)
    write(5, 100)  # the replacement has not joined: the same pid is not killed again
    time.sleep(0.1)
    write(5, 200)  # the replacement joined at step 5: not killed before step 6 (half of N after)
    time.sleep(0.1)
    assert killed == [100]
    write(6, 200)
    settle(2)
    result = k.stop()
    assert killed == [100, 200] and [r["step"] for r in result] == [2, 6]
