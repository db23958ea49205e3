"""CPU per thread of a running job, per RL step, over a window in the middle of RL.

    python perf/thread_cpu.py [--after-steps 60] [--window-s 20] -- asyncflow train grpo ... trainer.out_dir=DIR

Starts the command, waits until ``DIR/metrics.jsonl`` has ``--after-steps`` rows, reads the CPU
time of every thread of the command's processes (/proc/PID/task/TID/schedstat, in ns), waits
``--window-s`` seconds, reads again, and prints each thread's CPU milliseconds per RL step of the
window (busiest first) and each process's total. Thread names come from ``py-spy dump`` when
py-spy is installed (Python does not name its threads for the OS); else the OS name. The last
line is one JSON object. Where the control plane's CPU goes is what this is for: a step's
stages each run on some thread of some rank, beside the driver and the TransferQueue.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time


def _children(root: int) -> set[int]:
    kids, changed = {root}, True
    while changed:
        changed = False
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) in kids:
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid in kids:
                kids.add(int(d))
                changed = True
    return kids


def cpu_by_thread(pids: set[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (OS thread name, seconds on CPU)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            out[(pid, int(tid))] = (name, ns / 1e9)
    return out


def python_names(pids: set[int]) -> dict[int, str]:
    """tid -> Python thread name, from py-spy dump (empty without py-spy)."""
    spy = shutil.which("py-spy")
    names: dict[int, str] = {}
    for pid in pids if spy else ():
        try:
            text = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for m in re.finditer(r'Thread (\d+) \((?:\w+)\): "([^"]*)"', text):
            names[int(m.group(1))] = m.group(2)
    return names


def _by_thread(rows: list[tuple[float, int, str, int]]) -> dict[str, float]:
    """``pid:name`` -> CPU ms per step, for threads of at least 0.5 ms; a name its process
    repeats (torch's unnamed worker threads share the OS name) gets ``#tid`` so none is lost."""
    seen: dict[tuple[int, str], int] = {}
    for _, pid, name, _ in rows:
        seen[(pid, name)] = seen.get((pid, name), 0) + 1
    return {f"{pid}:{name}" + (f"#{tid}" if seen[(pid, name)] > 1 else ""): round(ms, 2)
            for ms, pid, name, tid in rows if ms >= 0.5}


def _rows(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after-steps", type=int, default=60, help="metrics.jsonl rows before the window")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command (its trainer.out_dir=... is read)")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    out_dir = next((x.split("=", 1)[1] for x in cmd if x.startswith("trainer.out_dir=")), None)
    if not cmd or out_dir is None:
        ap.error("give the command after --, with trainer.out_dir=DIR")
    if cmd[0] == "asyncflow":
        cmd = [sys.executable, "-m", "asyncflow.cli", *cmd[1:]]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    with open(out_dir.rstrip("/") + ".log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while _rows(metrics) < a.after_steps and proc.poll() is None:
            time.sleep(0.5)
        if proc.poll() is not None:
            print(f"the job ended before {a.after_steps} rows in {metrics} (exit code {proc.returncode})")
            return 1
        pids = _children(proc.pid)
        c0, n0, t0 = cpu_by_thread(pids), _rows(metrics), time.monotonic()
        time.sleep(a.window_s)
        c1, n1, t1 = cpu_by_thread(pids), _rows(metrics), time.monotonic()
        names = python_names(pids)
        proc.wait()
    steps = n1 - n0
    if steps <= 0:
        print("no RL step in the window: lengthen --window-s")
        return 1
    rows = []
    for key, (name, sec) in c1.items():
        used = sec - c0.get(key, (name, 0.0))[1]
        if used > 0:
            rows.append((used / steps * 1e3, key[0], names.get(key[1], name), key[1]))
    rows.sort(reverse=True)
    print(f"window {t1 - t0:.1f} s, {steps} RL steps ({(t1 - t0) / steps * 1e3:.0f} ms per step); "
          f"CPU ms per step by thread:")
    for ms, pid, name, _ in rows:
        if ms >= 0.5:
            print(f"  pid {pid:>7}  {name:<28} {ms:7.1f}")
    per_proc: dict[int, float] = {}
    for ms, pid, _, _ in rows:
        per_proc[pid] = per_proc.get(pid, 0.0) + ms
    print("per process:", ", ".join(f"pid {p} {ms:.1f}" for p, ms in sorted(per_proc.items())))
    print(json.dumps({"window_s": round(t1 - t0, 2), "steps": steps, "ms_per_step": round((t1 - t0) / steps * 1e3, 1),
                      "cpu_ms_per_step": _by_thread(rows),
                      "cpu_ms_per_step_by_process": {str(p): round(ms, 1) for p, ms in per_proc.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
