"""bench_e2e.py --fault N: the async job with one rollout instance killed every N RL steps,
against the same job with none, same seeds and the same warmed-up policy.

Both runs are the same command (1 training rank, 2 rollout instances, reward beside the
actor, fault.rollout_restarts=true: the same launcher), so the kills are the only
difference. A thread of this process watches the faulty run's metrics.jsonl and, every N
trained steps, SIGKILLs the current process of instance ``rollout1`` (ranks.json, which the
trainer writes again once a replacement has joined; a kill waits for the replacement, and for
half of N steps after it joined, so that a kill does not fall while the weight-sync groups
are made around the new process: that case is survived too, but the rendezvous may then wait
for the dead member up to weight_sync.timeout_s, a stall the steady state does not have).
Figures per run: samples/s over the RL phase, RL seconds to each held-out accuracy threshold
(evaluations every --fault-eval-every steps), the run's fault counters (summary.json). The
runs alternate which goes first, rep by rep.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FAULT_PLACEMENT = ["trainer.nproc=3", "placement.mode=disaggregated", "placement.actor_ranks=[0]",
                   "placement.rollout_ranks=[1,2]", "placement.reward_with=actor", "placement.ref_with=actor",
                   "workflow.mode=async", "fault.rollout_restarts=true", "fault.max_restarts_per_instance=1000",
                   "fault.max_restarts_per_run=1000", "fault.backoff_s=0.5"]
VICTIM = "rollout1"


def trained_steps(metrics_text: str) -> int:
    """RL steps reported so far in a metrics.jsonl's text."""
    return sum('"actor/loss"' in line and '"phase"' not in line for line in metrics_text.splitlines())


def victim_pid(ranks_json: str, role: str = VICTIM) -> int | None:
    for w in json.loads(ranks_json):
        if role in (w.get("roles") or []):
            return int(w["pid"])
    return None


def kills_due(steps: int, every: int, done: int, joined_at: int | None = None) -> bool:
    """Whether another kill is due after ``steps`` trained steps, ``done`` kills so far, the
    last victim's replacement seen joined at step ``joined_at`` (None: no kill yet)."""
    settled = joined_at is None or steps >= joined_at + max(1, every // 2)
    return every > 0 and steps >= (done + 1) * every and settled


def seconds_to(metrics: Sequence[dict], thresholds: Sequence[float]) -> dict[str, float | None]:
    """RL seconds (from the before-RL evaluation) at which held-out accuracy first reached each
    threshold during RL or after it; None: never."""
    start = next((float(m["time_s"]) for m in metrics if m.get("phase") == "before_rl"), None)
    evals = [(float(m["time_s"]) - start, float(m["eval/accuracy"])) for m in metrics
             if start is not None and m.get("phase") in ("rl", "after_rl") and "eval/accuracy" in m]
    return {f"{t:g}": next((s for s, acc in evals if acc >= t), None) for t in thresholds}


class Killer:
    """Kills the victim instance's current process every ``every`` trained steps of ``run_dir``."""

    def __init__(self, run_dir: Path, every: int, poll_s: float = 0.2,
                 kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL)):
        self.run_dir, self.every, self.poll_s, self.kill = run_dir, every, poll_s, kill
        self.killed: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-killer", daemon=True)

    def start(self) -> Killer:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        return self.killed

    def _run(self) -> None:
        last_pid = None
        joined_at: int | None = None  # the step at which the last victim's replacement was seen
        while not self._stop.wait(self.poll_s):
            try:
                steps = trained_steps((self.run_dir / "metrics.jsonl").read_text())
                pid = victim_pid((self.run_dir / "ranks.json").read_text())
            except (OSError, ValueError):
                continue
            if pid is None or pid == last_pid:
                continue  # the last victim's replacement has not joined yet
            if last_pid is not None and joined_at is None:
                joined_at = steps
            if not kills_due(steps, self.every, len(self.killed), joined_at):
                continue
            try:
                self.kill(pid)
            except ProcessLookupError:
                continue
            last_pid, joined_at = pid, None
            self.killed.append({"step": steps, "pid": pid, "t": time.time()})


def run_fault_bench(a: Any, out: Path, model: Path, train: Callable, start_from: Callable,
                    workload: list[str]) -> dict:
    """The pairs of runs (bench_e2e's ``train`` and overrides); results in out/fault/results.json."""
    parent = out / "fault"
    parent.mkdir(parents=True, exist_ok=True)
    thresholds = [float(x) for x in str(a.fault_thresholds).split(",") if x.strip()]
    common = [*workload, *start_from(model), *FAULT_PLACEMENT, f"trainer.eval_every={a.fault_eval_every}"]
    runs: list[dict] = []
    for rep in range(max(1, a.reps)):
        order = ("none", "fault") if rep % 2 == 0 else ("fault", "none")
        for kind in order:
            name = f"{kind}_rep{rep}"
            run_dir = parent / name
            killer = Killer(run_dir, a.fault) if kind == "fault" else None
            if killer is not None:
                killer.start()
            try:
                rc, wall, log = train(name, common, run_dir, a.run_timeout_s)
            finally:
                kills = killer.stop() if killer is not None else []
            res: dict = {"kind": kind, "rep": rep, "exit": rc, "wall_s": wall, "kills": len(kills), "log": str(log)}
            if (run_dir / "summary.json").is_file():
                s = json.loads((run_dir / "summary.json").read_text())
                metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
                res.update({"samples_per_s": s.get("samples_per_s"), "rl_s": s.get("rl_s"),
                            "steps": s.get("rl_steps"), "accuracy_after": s.get("eval_accuracy_after_rl"),
                            "rl_s_to_accuracy": seconds_to(metrics, thresholds), "faults": s.get("faults")})
            runs.append(res)
            print(f"  {name}: exit {rc}, {res.get('samples_per_s') or float('nan'):.1f} samples/s, "
                  f"{len(kills)} kills, to accuracy {res.get('rl_s_to_accuracy')}", flush=True)
    result = {"every_steps": a.fault, "thresholds": thresholds, "seed": a.seed, "steps": a.steps, "runs": runs}
    (parent / "results.json").write_text(json.dumps(result, indent=1))
    return result
