"""Soak test: the default async GRPO job for a long time, watching every process's memory.

Runs ``python -m asyncflow.cli train`` (recipe grpo, async, disaggregated, the built-in
tiny model on 2 CPU ranks) as a subprocess in its own process group, with
``trainer.time_budget_s`` set to the soak length and ``trainer.steps`` out of reach, and
every ``--interval`` seconds reads the resident memory (VmRSS and RssAnon from
/proc/<pid>/status, no psutil) of the launcher and all its descendants (found by walking
/proc for ppids): the launcher, torch's elastic ranks (rank 0 also runs the driver; named
from the run's ranks.json with their roles, else by start order, which is local-rank
order), the TransferQueue service's process (``tq_service``, a child of rank 0) and
multiprocessing's resource tracker.

What it reports:

- memory, judged per process: the least-squares slope of each process's own RSS against
  time, in MB/hour (MB = 2**20 bytes), over the steady part of RL only. The verdict fails
  if ANY process reaches the target (``--target``, default 20 MB/hour): the slope of the
  sum over processes is printed for reference but judges nothing, since one process giving
  memory back can hide another's climb. Processes are named stably (launcher,
  resource_tracker, rank0, rank1, ...; roles from the run's ranks.json beside them); each
  is fitted over its own samples inside the window, and one present for under half of the
  window or in fewer than 3 samples is listed as not judged. Each process is also fitted
  and judged over the last half of the window alone, and fails if either slope reaches
  the target: a one-off release early on can hide a steady climb in the whole window's
  slope, and a process flat at first that starts climbing halfway shows only half its
  late slope there.
  The supervised warm-up, the first evaluation and model loading allocate on purpose, so
  the window starts at the RL start (the ``before_rl`` evaluation row of the run's
  metrics.jsonl, else its first RL step row) plus ``--settle`` (default 20%) of the RL
  time; it ends with RL, at the last sample taken before the last RL step row was written
  (each sample reads RSS first, then metrics.jsonl, which the run flushes per row), so
  none of the final evaluation, checkpoint and export that follow (they allocate on
  purpose too) is fitted. metrics.jsonl counts seconds from the driver's own start; the
  offset to this script's clock is the smallest (sample time - newest ``time_s`` seen by
  then).
- TransferQueue: the per-RL-step metrics ``tq/rows_held`` / ``tq/bytes_held`` (rows and
  bytes in all storage units after the step's partition is cleared): max, final, and
  whether they stay bounded (the max over the second half of RL no more than the max over
  the first half plus one step's rows). A run that does not log them is reported as such.
- errors: the run's exit code, Traceback blocks and other error lines in its stdout and
  stderr, reward errors and timeouts from summary.json.

It writes under --out (default: a new temp dir): ``run/`` (the training run's out_dir),
``train.stdout.log``, ``train.stderr.log``, ``rss.jsonl`` (one line per sample: ``t_s``
since launch, the newest metrics ``time_s`` seen, and per pid its label, VmRSS and RssAnon
in kB), ``rss.png`` (RSS over time per process and the total) and ``soak.json``; appends a
section to perf/RESULTS.md unless ``--no-record``. The last line printed is one JSON
object: ``verdict`` (pass, FAIL or not judged), ``target_mb_per_h``, ``failing``, and per
process under ``processes`` its slope, window start and end (minutes since launch),
verdict, and its slope and verdict over the window's last half; then ``steps``, ``errors``
and the TransferQueue figures. The exit code is 0 only when the run ended well and the memory
verdict is pass.

``--quick`` is a check of the script, not a soak: 3 minutes of RL after at most 100
warm-up steps (about 4 minutes in all on a quiet 2-core machine). Its slopes come from a
2.4-minute window, where 1 MB of noise reads as 25 MB/hour: its verdict means nothing.

    python perf/soak.py [--minutes 30 | --quick] [--interval S] [--settle F] [--target MB_PER_H]
                        [--out DIR] [--no-record] [key=value ...]
    python perf/soak.py --reanalyse DIR [--settle F] [--target MB_PER_H] [--no-record]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_overrides import check_overrides  # perf/'s own module, beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "perf" / "RESULTS.md"
TARGET_MB_PER_H = 20.0  # every process under this over a 30-minute soak
KB_PER_MB = 1024.0
# a process is judged only on enough of the window: a short-lived one ramping up at start
# would otherwise read as a huge slope
MIN_COVER = 0.5
MIN_SAMPLES = 3
PASS, FAIL, NOT_JUDGED = "pass", "FAIL", "not judged"
# the keys this script sets for the run, and how to set them
OWNED_KEYS = {"trainer.out_dir": "--out", "trainer.time_budget_s": "--minutes", "trainer.steps": "--minutes"}

# ---- reading /proc (pure parsers, then the thin readers) -------------------------------------


def parse_status_kb(text: str, field: str = "VmRSS") -> int | None:
    """The kB value of ``field`` in a /proc/<pid>/status text; None when absent (a zombie has no VmRSS)."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name == field:
            parts = rest.split()
            if not parts:
                return None
            if len(parts) > 1 and parts[1] != "kB":
                raise ValueError(f"/proc status field {field}: unexpected unit in {line!r}")
            return int(parts[0])
    return None


def parse_stat(text: str) -> tuple[int, int]:
    """(ppid, start time in clock ticks) from a /proc/<pid>/stat line.

    The command name (field 2) is in parentheses and may itself hold spaces or ')', so the
    fields are counted from the last ')'.
    """
    end = text.rfind(")")
    if end < 0:
        raise ValueError(f"/proc stat line without a command name: {text[:80]!r}")
    rest = text[end + 1:].split()  # rest[0] is field 3 (state)
    if len(rest) < 20:
        raise ValueError(f"/proc stat line too short: {text[:80]!r}")
    return int(rest[1]), int(rest[19])  # field 4 ppid, field 22 starttime


def descendants(ppids: dict[int, int], root: int) -> list[int]:
    """``root`` and every process below it, given pid -> ppid; parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


def label_for(cmdline: str, is_root: bool) -> str:
    """A short role name from a process's command line (the rank number is added by start order)."""
    if is_root:
        return "launcher"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    if "spawn_main" in cmdline or "--multiprocessing-fork" in cmdline:
        return "rank"
    if "asyncflow.transfer_queue.service_process" in cmdline:
        return "tq_service"
    words = cmdline.split()
    return Path(words[0]).name if words else "?"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # the process ended between listing and reading


def proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, start ticks) of every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            text = _read(f"/proc/{name}/stat")
            if text:
                out[int(name)] = parse_stat(text)
    return out


class Sampler:
    """Reads the RSS of a process tree; labels stay fixed per pid once given."""

    def __init__(self, root: int):
        self.root = root
        self.labels: dict[int, str] = {}
        self.ranks_seen = 0

    def sample(self) -> dict[int, dict[str, Any]]:
        table = proc_table()
        if self.root not in table:
            return {}
        pids = descendants({p: v[0] for p, v in table.items()}, self.root)
        new = sorted((p for p in pids if p not in self.labels), key=lambda p: table[p][1])  # by start time
        for pid in new:
            cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
            label = label_for(cmd, pid == self.root)
            if label == "rank":  # elastic starts local ranks in order: the n-th spawned child is rank n
                label = f"rank{self.ranks_seen}"
                self.ranks_seen += 1
            self.labels[pid] = label
        out = {}
        for pid in pids:
            status = _read(f"/proc/{pid}/status")
            rss = parse_status_kb(status) if status else None
            if rss is None:
                continue
            out[pid] = {"label": self.labels[pid], "ppid": table[pid][0], "rss_kb": rss,
                        "anon_kb": parse_status_kb(status, "RssAnon")}
        return out


# ---- the analysis (pure) ---------------------------------------------------------------------


def relabel_ranks(samples: Sequence[dict], ranks: Sequence[dict]) -> None:
    """Name rank processes from the run's ranks.json (rank, pid, roles), in place.

    The label stays the bare ``rank<N>`` (a name that means the same in every run); the
    roles go beside it. The start-order guess is kept for pids the file does not list (an
    older trainer writes no ranks.json).
    """
    by_pid = {str(r["pid"]): r for r in ranks if "pid" in r}
    for s in samples:
        for pid, p in s["procs"].items():
            if pid in by_pid:
                p["label"] = f"rank{by_pid[pid]['rank']}"
                p["roles"] = ",".join(by_pid[pid].get("roles", []))


def slope(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against ts (units of y per unit of t); None below 2 distinct times."""
    n = len(ts)
    if n != len(ys):
        raise ValueError(f"slope: {n} times but {len(ys)} values")
    if n < 2:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx


def kb_per_s_to_mb_per_h(x: float | None) -> float | None:
    return None if x is None else x * 3600.0 / KB_PER_MB


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a cut-off or broken line (a killed run) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def is_rl_step(row: dict) -> bool:
    """RL step rows carry no ``phase`` (warm-up and evaluation rows do)."""
    return "phase" not in row and "time_s" in row


def rl_window(metrics: Sequence[dict]) -> tuple[float | None, float | None, int]:
    """(RL start, time of the last RL step row, RL steps) in metrics time_s.

    The start is the ``before_rl`` evaluation row (right before the first step is issued),
    else the first RL step row less its step time; None when RL never began.
    """
    start = next((r["time_s"] for r in metrics if r.get("phase") == "before_rl"), None)
    steps = [r for r in metrics if is_rl_step(r)]
    if start is None and steps:
        start = steps[0]["time_s"] - float(steps[0].get("step_time_s", 0.0))
    end = steps[-1]["time_s"] if steps else None
    return start, end, (max(int(r["step"]) for r in steps) if steps else 0)


def clock_offset(pairs: Iterable[tuple[float, float | None]]) -> float | None:
    """Offset from metrics ``time_s`` to the sampler's clock: min(sample t - newest time_s seen then).

    A row is read at or after it was written, so each difference is at least the true
    offset; a sample taken just after a row (RL steps log every fraction of a second)
    comes within a sample's read latency of it.
    """
    diffs = [t - m for t, m in pairs if m is not None]
    return min(diffs) if diffs else None


def rl_end_sample_time(samples: Sequence[dict], rl_end: float) -> float | None:
    """Sampler time of the last sample taken before the run wrote its last RL step row.

    A sample reads RSS first and metrics.jsonl second, and the run flushes every row, so a
    sample that had not yet seen that row was taken during RL; one that had may already
    fall in the final evaluation or export. None when no sample saw an earlier row.
    """
    ts = [s["t_s"] for s in samples if s.get("metrics_time_s") is not None and s["metrics_time_s"] < rl_end]
    return max(ts) if ts else None


def stable_names(samples: Sequence[dict]) -> dict[str, str]:
    """pid -> a name that means the same in every run: the label (rank0, launcher, ...).

    A label held by several pids (a restarted process) gets ``#2``, ``#3`` ... in order of
    first appearance, so no two processes share a row.
    """
    seen: dict[str, int] = {}
    names: dict[str, str] = {}
    for s in samples:
        for pid in sorted(s["procs"], key=int):
            if pid not in names:
                label = s["procs"][pid]["label"]
                seen[label] = seen.get(label, 0) + 1
                names[pid] = label if seen[label] == 1 else f"{label}#{seen[label]}"
    return names


@dataclass(frozen=True)
class ProcessFit:
    """One process's RSS over the samples of a window where it was present."""
    name: str
    pid: int
    roles: str
    samples: int
    t_from: float  # its first and last sample in the window: the span its slope covers
    t_to: float
    slope_mb_per_h: float | None
    anon_slope_mb_per_h: float | None
    rss_mb_start: float
    rss_mb_end: float
    rss_mb_max: float
    verdict: str = NOT_JUDGED
    why: str = ""


def fit_process(name: str, pid: str, win: Sequence[dict]) -> ProcessFit:
    """The slope of one process's RSS over the window's samples that hold it."""
    own = [s for s in win if pid in s["procs"]]
    if not own:
        raise ValueError(f"fit_process: {name} (pid {pid}) is in no sample of the window")
    ts = [s["t_s"] for s in own]
    ys = [s["procs"][pid]["rss_kb"] for s in own]
    anon = [s["procs"][pid].get("anon_kb") for s in own]
    first = own[0]["procs"][pid]
    return ProcessFit(
        name=name, pid=int(pid), roles=first.get("roles", ""), samples=len(own), t_from=ts[0], t_to=ts[-1],
        slope_mb_per_h=kb_per_s_to_mb_per_h(slope(ts, ys)),
        anon_slope_mb_per_h=kb_per_s_to_mb_per_h(slope(ts, anon)) if None not in anon else None,
        rss_mb_start=ys[0] / KB_PER_MB, rss_mb_end=ys[-1] / KB_PER_MB, rss_mb_max=max(ys) / KB_PER_MB)


def judge(fit: ProcessFit, window: tuple[float, float], target: float) -> ProcessFit:
    """The fit with its verdict: FAIL at or above ``target`` MB/hour, pass below, or not judged
    when it covers too little of the window for its slope to say anything."""
    span = window[1] - window[0]
    if fit.slope_mb_per_h is None or fit.samples < MIN_SAMPLES:
        return replace(fit, verdict=NOT_JUDGED, why=f"{fit.samples} samples in the window (need {MIN_SAMPLES})")
    if span > 0 and fit.t_to - fit.t_from < MIN_COVER * span:
        return replace(fit, verdict=NOT_JUDGED, why=f"present {(fit.t_to - fit.t_from) / 60:.1f} of "
                                                     f"{span / 60:.1f} min of the window")
    if fit.slope_mb_per_h >= target:
        return replace(fit, verdict=FAIL, why=f"{fit.slope_mb_per_h:.1f} >= {target:g} MB/hour")
    return replace(fit, verdict=PASS, why=f"{fit.slope_mb_per_h:.1f} < {target:g} MB/hour")


@dataclass(frozen=True)
class MemoryVerdict:
    """The run's verdict: FAIL if any process fails, pass if at least one was judged and none failed."""
    verdict: str
    target_mb_per_h: float
    failing: list[str]
    not_judged: list[str]

    @property
    def met(self) -> bool:
        return self.verdict == PASS


def overall_verdict(fits: Mapping[str, ProcessFit], target: float) -> MemoryVerdict:
    failing = [n for n, f in fits.items() if f.verdict == FAIL]
    not_judged = [n for n, f in fits.items() if f.verdict == NOT_JUDGED]
    passed = any(f.verdict == PASS for f in fits.values())
    verdict = FAIL if failing else PASS if passed else NOT_JUDGED
    return MemoryVerdict(verdict, target, failing, not_judged)


def fit_memory(samples: Sequence[dict], t_from: float, t_to: float, target: float = TARGET_MB_PER_H,
               names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per-process RSS slopes (MB/hour) and verdicts over samples with t_from <= t_s <= t_to.

    Each process is fitted over its own samples in the window. The slope of the sum is
    kept for reference only (it judges nothing) and counts only processes present in every
    sample of the window (one that starts or ends inside it would make the sum jump);
    the others are listed under ``partial``. ``names`` maps pid to a stable name (from all
    samples, so that two windows of one run agree); by default it is made from ``samples``.
    """
    names = dict(names) if names is not None else stable_names(samples)
    win = [s for s in samples if t_from <= s["t_s"] <= t_to]
    pids = sorted({pid for s in win for pid in s["procs"]}, key=int)
    missing = [pid for pid in pids if pid not in names]
    if missing:
        raise ValueError(f"fit_memory: pids {missing} have no name (names made from other samples?)")
    fits = {names[pid]: judge(fit_process(names[pid], pid, win), (t_from, t_to), target) for pid in pids}
    out: dict[str, Any] = {"samples": len(win), "t_from": t_from, "t_to": t_to, "processes": fits,
                           "verdict": overall_verdict(fits, target), "total": None, "total_anon": None,
                           "partial": []}
    if len(win) < 2:
        return out
    whole = set(win[0]["procs"])
    for s in win[1:]:
        whole &= set(s["procs"])
    out["partial"] = [names[pid] for pid in pids if pid not in whole]
    ts = [s["t_s"] for s in win]
    total = [sum(s["procs"][p]["rss_kb"] for p in whole) for s in win]
    anon_ok = all(s["procs"][p].get("anon_kb") is not None for s in win for p in whole)
    total_anon = [sum(s["procs"][p]["anon_kb"] for p in whole) for s in win] if anon_ok else None
    out.update({"total": kb_per_s_to_mb_per_h(slope(ts, total)),
                "total_anon": kb_per_s_to_mb_per_h(slope(ts, total_anon)) if total_anon else None,
                "total_mb_start": total[0] / KB_PER_MB, "total_mb_end": total[-1] / KB_PER_MB})
    return out


def judge_with_last_half(mem: Mapping[str, Any], late: Mapping[str, Any]) -> dict[str, Any]:
    """``mem`` (a :func:`fit_memory` of the whole window) with each process failing also when
    its fit over the last half of the window (``late``, same names) fails; the run's verdict
    again from those. A process passes on the whole window's fit when its last half cannot be
    judged (too few samples there)."""
    fits: dict[str, ProcessFit] = {}
    for name, fit in mem["processes"].items():
        lf = late["processes"].get(name)
        if fit.verdict != FAIL and lf is not None and lf.verdict == FAIL:
            fit = replace(fit, verdict=FAIL, why=f"last half of the window: {lf.why}")
        fits[name] = fit
    return {**mem, "processes": fits, "verdict": overall_verdict(fits, mem["verdict"].target_mb_per_h)}


def tq_figures(metrics: Sequence[dict], rows_per_step: int | None) -> dict[str, Any]:
    """What the per-step ``tq/rows_held`` / ``tq/bytes_held`` say about rows being freed."""
    rows = [(int(r["step"]), r["tq/rows_held"]) for r in metrics if is_rl_step(r) and "tq/rows_held" in r]
    nbytes = [int(r["tq/bytes_held"]) for r in metrics if is_rl_step(r) and "tq/bytes_held" in r]
    n_steps = sum(1 for r in metrics if is_rl_step(r))
    if not rows:
        return {"logged": False, "note": f"metrics.jsonl has no tq/rows_held in its {n_steps} RL step rows: "
                                         "the trainer of this checkout does not log it; rows held not measured"}
    vals = [int(v) for _, v in rows]
    half = len(vals) // 2
    first, second = (vals[:half], vals[half:]) if half else (vals, vals)
    slack = rows_per_step or 0
    out: dict[str, Any] = {
        "logged": True, "steps_with_metric": len(rows), "rows_held_max": max(vals), "rows_held_final": vals[-1],
        "rows_held_mean": sum(vals) / len(vals), "rows_held_max_first_half": max(first),
        "rows_held_max_second_half": max(second), "rows_per_step": rows_per_step,
        # rows held per step of rows: how many steps' worth stay in the queue after a clear
        "rows_held_max_in_steps": (max(vals) / rows_per_step) if rows_per_step else None,
        "rows_held_slope_per_1000_steps": (lambda s: None if s is None else s * 1000)(
            slope([float(s) for s, _ in rows], [float(v) for v in vals])),
        # bounded: the second half never holds more than the first half did, give or take one
        # step's rows (which steps are in flight when a step closes varies)
        "bounded": max(second) <= max(first) + slack,
    }
    if nbytes:
        out.update({"bytes_held_max": max(nbytes), "bytes_held_final": nbytes[-1]})
    return out


_TB_START = "Traceback (most recent call last):"
# ERROR (a logger that prints its level), a bare exception line, the launcher's failure lines
_ERROR_LINE = re.compile(r"\bERROR\b|^\s*[\w.]*(Error|Exception):|asyncflow (run|driver) failed")


def scan_log(text: str) -> dict[str, Any]:
    """Traceback blocks and other error lines (outside tracebacks) in a run's output."""
    tracebacks, error_lines, examples = 0, 0, []
    in_tb = False
    for line in text.splitlines():
        if _TB_START in line:
            tracebacks += 1
            in_tb = True
            examples.append(line.strip())
            continue
        if in_tb:
            if line.startswith((" ", "\t", "During handling", "The above exception")) or not line.strip():
                continue
            in_tb = False  # the exception line closes the block
            examples[-1] = line.strip()[:200]
            continue
        if _ERROR_LINE.search(line):
            error_lines += 1
            examples.append(line.strip()[:200])
    return {"tracebacks": tracebacks, "error_lines": error_lines, "examples": examples[:5]}


def count_errors(rc: int | str | None, logs: Sequence[dict], summary: dict) -> int:
    """One number for the JSON line: a failed exit, each traceback, each error line, each reward failure."""
    n = 0 if rc == 0 else 1
    n += sum(x["tracebacks"] + x["error_lines"] for x in logs)
    n += int(summary.get("reward/errors", 0) or 0) + int(summary.get("reward/timeouts", 0) or 0)
    return n


# ---- running ---------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the run's process group, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def newest_time_s(path: Path, state: dict) -> float | None:
    """The largest ``time_s`` in metrics.jsonl so far, reading only what was appended since last time."""
    if not path.is_file():
        return state.get("max")
    if path.stat().st_size < state.get("pos", 0):  # rewritten from the start (a new logger truncates it)
        state.update(pos=0, partial=b"")
    with open(path, "rb") as f:
        f.seek(state.get("pos", 0))
        chunk = f.read()
    text = state.get("partial", b"") + chunk
    lines = text.split(b"\n")
    state["partial"] = lines.pop()  # an incomplete last line waits for the next read
    state["pos"] = state.get("pos", 0) + len(chunk)
    for line in lines:
        try:
            t = json.loads(line).get("time_s")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(t, (int, float)):
            state["max"] = max(state.get("max", t), t)
    return state.get("max")


def run_and_sample(cmd: list[str], out: Path, run_dir: Path, interval: float, deadline_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    with open(out / "train.stdout.log", "w") as so, open(out / "train.stderr.log", "w") as se, \
            open(out / "rss.jsonl", "w") as rss_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
        sampler = Sampler(proc.pid)
        state: dict = {}
        samples, killed = [], None
        try:
            while True:
                t = time.monotonic() - t0
                procs = sampler.sample()
                if procs:
                    s = {"t_s": round(t, 3), "metrics_time_s": newest_time_s(run_dir / "metrics.jsonl", state),
                         "procs": {str(p): v for p, v in procs.items()}}
                    samples.append(s)
                    rss_file.write(json.dumps(s) + "\n")
                    rss_file.flush()
                if proc.poll() is not None:
                    break
                if t > deadline_s:
                    killed = f"still running after {deadline_s:.0f} s: stopped"
                    stop_group(proc)
                    break
                time.sleep(max(0.0, interval - (time.monotonic() - t0 - t)))
        except KeyboardInterrupt:
            killed = "interrupted"
            stop_group(proc)
        finally:
            if proc.poll() is None:
                stop_group(proc)
    rc = proc.returncode
    return {"rc": rc, "killed": killed, "samples": samples, "wall_s": time.monotonic() - t0}


def fit_window(samples: Sequence[dict], offset: float | None, rl_start: float | None, rl_end: float | None,
               settle: float) -> tuple[float, float, list[str]]:
    """(start, end) of the fit on the sampler's clock, and notes on how it was found.

    Start: the RL start plus ``settle`` of the RL time (warm-up exclusion). End: the last
    sample taken before the last RL step row was written, so the final evaluation and
    export stay out; failing that, that row's time through the clock offset.
    """
    notes: list[str] = []
    t_last = samples[-1]["t_s"] if samples else 0.0
    if offset is None or rl_start is None:
        notes.append("RL start not found in metrics.jsonl: the fit covers the last 80% of the run's samples")
        return 0.2 * t_last, t_last, notes
    a = offset + rl_start
    if rl_end is None:
        notes.append("no RL step row in metrics.jsonl: the fit runs to the last sample")
        b = t_last
    else:
        cut = rl_end_sample_time(samples, rl_end)
        if cut is None:
            notes.append("no sample before the last RL step row: the fit ends at that row's time via the clock offset")
        b = offset + rl_end if cut is None else cut
    return a + settle * max(b - a, 0.0), b, notes


def analyse(res: dict, out: Path, run_dir: Path, settle: float, target: float = TARGET_MB_PER_H) -> dict[str, Any]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    samples = res["samples"]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    if (run_dir / "ranks.json").is_file():
        try:
            relabel_ranks(samples, json.loads((run_dir / "ranks.json").read_text()))
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # labels by start order stay
    offset = clock_offset((s["t_s"], s["metrics_time_s"]) for s in samples)
    rl_start, rl_end, steps = rl_window(metrics)
    a, b, notes = fit_window(samples, offset, rl_start, rl_end, settle)
    names = stable_names(samples)
    # the second half on its own: a one-off release early in the window can hide a steady
    # climb, and a climb that starts halfway shows at half its slope over the whole window
    late = fit_memory(samples, (a + b) / 2, b, target, names)
    mem = judge_with_last_half(fit_memory(samples, a, b, target, names), late)
    if mem["partial"]:
        notes.append(f"left out of the sum (not present through the whole window): {', '.join(mem['partial'])}")
    if mem["verdict"].not_judged:
        notes.append("not judged (too little of the window): " + ", ".join(
            f"{n} ({mem['processes'][n].why})" for n in mem["verdict"].not_judged))
    try:
        rows_per_step = int(config["trainer"]["prompts_per_step"]) * int(config["rollout"]["n"])
    except (KeyError, TypeError, ValueError):
        rows_per_step = None
    tq = tq_figures(metrics, rows_per_step)
    logs = {name: scan_log((out / f"train.{name}.log").read_text(errors="replace")) for name in ("stdout", "stderr")}
    errors = count_errors(res["rc"], list(logs.values()), summary) + (1 if res["killed"] else 0)
    return {"offset_s": offset, "rl_start_s": None if offset is None or rl_start is None else offset + rl_start,
            "rl_end_s": None if offset is None or rl_end is None else offset + rl_end, "window": [a, b],
            "target_mb_per_h": target,
            "steps": steps, "rl_steps_summary": summary.get("rl_steps"), "memory": mem, "memory_last_half": late,
            "tq": tq, "logs": logs,
            "errors": errors, "reward_errors": summary.get("reward/errors"),
            "reward_timeouts": summary.get("reward/timeouts"), "notes": notes,
            "eval_accuracy": [summary.get("eval_accuracy_before_rl"), summary.get("eval_accuracy_after_rl")]}


# ---- output ----------------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def plot(samples: Sequence[dict], an: dict, path: Path) -> Path:
    import matplotlib  # lazy: only when drawing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axt) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    names = stable_names(samples)
    fits = an["memory"]["processes"]
    for pid in sorted(names, key=int):
        pts = [(s["t_s"] / 60, s["procs"][pid]["rss_kb"] / KB_PER_MB) for s in samples if pid in s["procs"]]
        f = fits.get(names[pid])
        ax.plot([p[0] for p in pts], [p[1] for p in pts],
                label=f"{names[pid]} (pid {pid}): {fmt(f.slope_mb_per_h if f else None)} MB/h "
                      f"{f.verdict if f else 'outside the window'}")
    axt.plot([s["t_s"] / 60 for s in samples], [sum(p["rss_kb"] for p in s["procs"].values()) / KB_PER_MB
                                                  for s in samples], color="k", label="sum (not judged)")
    for a in (ax, axt):
        if an.get("rl_start_s") is not None:
            a.axvline(an["rl_start_s"] / 60, color="g", ls="--", lw=1, label="RL start")
        a.axvspan(an["window"][0] / 60, an["window"][1] / 60, color="y", alpha=0.15, label="fit window")
        a.set_ylabel("RSS (MB)")
        a.legend(fontsize=8, loc="lower right")
        a.grid(alpha=0.3)
    axt.set_xlabel("minutes since launch")
    v = an["memory"]["verdict"]
    ax.set_title(f"asyncflow train soak: RSS per process; verdict {v.verdict} (every process under "
                 f"{v.target_mb_per_h:g} MB/h over the fit window and its last half)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def machine_line() -> str:
    try:
        from importlib.metadata import version
        torch_v = version("torch")
    except Exception:  # noqa: BLE001 - only for the record line
        torch_v = "?"
    return (f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, Python {platform.python_version()}, "
            f"torch {torch_v}")


def record(an: dict, cmd_line: str, minutes: float | None, interval: float | None, path: Path = RESULTS_MD,
           load_end: float | None = None) -> None:
    """Append this soak's section to perf/RESULTS.md."""
    mem, tq, late = an["memory"], an["tq"], an["memory_last_half"]
    v: MemoryVerdict = mem["verdict"]
    lines = ["", f"## Soak (`perf/soak.py`), {dt.date.today().isoformat()}", "",
             (f"{machine_line()}; load average at the end of the run {fmt(load_end)} (other work may share the "
              f"machine). Command: `{cmd_line}` ({fmt(minutes, 'g')} min of RL, RSS sampled every "
              f"{fmt(interval, 'g')} s; the fit "
              f"window is RL after its first {an['settle'] * 100:.0f}% up to the last sample before the last RL "
              f"step, {an['window'][0] / 60:.1f}-{an['window'][1] / 60:.1f} min after launch, "
              f"{mem['samples']} samples)."), "",
             ("| process | roles | fitted from-to (min) | RSS at start MB | at end MB | slope MB/hour "
              "| slope, last half of the window | anonymous memory slope MB/hour | verdict |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for name, p in mem["processes"].items():
        lp = late["processes"].get(name)
        lines.append(f"| {name} (pid {p.pid}) | {p.roles or '-'} | {p.t_from / 60:.1f}-{p.t_to / 60:.1f} "
                     f"| {p.rss_mb_start:.0f} | {p.rss_mb_end:.0f} | {fmt(p.slope_mb_per_h)} "
                     f"| {fmt(lp.slope_mb_per_h if lp else None)} | {fmt(p.anon_slope_mb_per_h)} "
                     f"| {'**FAIL**' if p.verdict == FAIL else p.verdict} |")
    lines.append(f"| sum (not judged) | | | {fmt(mem.get('total_mb_start'), '.0f')} | "
                 f"{fmt(mem.get('total_mb_end'), '.0f')} | {fmt(mem['total'])} | {fmt(late['total'])} "
                 f"| {fmt(mem['total_anon'])} | |")
    lines += ["", (f"Verdict (every process under {v.target_mb_per_h:g} MB/hour over the fit window and over its "
                   f"last half): "
                   f"{'**FAIL** (' + ', '.join(v.failing) + ')' if v.verdict == FAIL else v.verdict}. "
                   f"RL steps: {an['steps']}; errors: {an['errors']} (exit code {an['rc']}, tracebacks "
                   f"{sum(x['tracebacks'] for x in an['logs'].values())}, error lines "
                   f"{sum(x['error_lines'] for x in an['logs'].values())}, reward errors "
                   f"{fmt(an['reward_errors'], 'g')}, "
                   f"timeouts {fmt(an['reward_timeouts'], 'g')}).")]
    if tq["logged"]:
        lines.append(f"TransferQueue rows held after each step's clear: max {tq['rows_held_max']}, final "
                     f"{tq['rows_held_final']}, max in the first half of RL {tq['rows_held_max_first_half']} vs "
                     f"second half {tq['rows_held_max_second_half']} ({tq['rows_per_step']} rows per step): "
                     f"{'bounded' if tq['bounded'] else '**growing**'}; bytes held max "
                     f"{fmt(tq.get('bytes_held_max'), ',')} B, final {fmt(tq.get('bytes_held_final'), ',')} B.")
    else:
        lines.append(f"TransferQueue rows held: not measured ({tq['note']}).")
    lines += [f"Note: {n}." for n in an["notes"]]
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(lines) + "\n")


def print_table(an: dict) -> None:
    mem, tq, late = an["memory"], an["tq"], an["memory_last_half"]
    v: MemoryVerdict = mem["verdict"]
    print()
    print(f"fit window {an['window'][0] / 60:.1f}-{an['window'][1] / 60:.1f} min after launch "
          f"(RL start {fmt(None if an['rl_start_s'] is None else an['rl_start_s'] / 60, '.1f')} min, last RL step "
          f"{fmt(None if an['rl_end_s'] is None else an['rl_end_s'] / 60, '.1f')} min), {mem['samples']} samples")
    print(f"{'process':18} {'roles':22} {'pid':>7} {'from-to min':>11} {'start MB':>9} {'end MB':>9} "
          f"{'max MB':>9} {'MB/hour':>9} {'last half':>9} {'anon MB/h':>9}  verdict")
    for name, p in mem["processes"].items():
        lp = late["processes"].get(name)
        window = f"{p.t_from / 60:.1f}-{p.t_to / 60:.1f}"
        print(f"{name:18} {p.roles or '-':22} {p.pid:>7} {window:>11} {p.rss_mb_start:9.1f} {p.rss_mb_end:9.1f} "
              f"{p.rss_mb_max:9.1f} {fmt(p.slope_mb_per_h):>9} {fmt(lp.slope_mb_per_h if lp else None):>9} "
              f"{fmt(p.anon_slope_mb_per_h):>9}  {p.verdict}" + ("" if p.verdict == PASS else f" ({p.why})"))
    print(f"{'sum (not judged)':18} {'':22} {'':>7} {'':>11} {fmt(mem.get('total_mb_start')):>9} "
          f"{fmt(mem.get('total_mb_end')):>9} {'':>9} {fmt(mem['total']):>9} {fmt(late['total']):>9} "
          f"{fmt(mem['total_anon']):>9}")
    print(f"memory verdict: {v.verdict} (every process under {v.target_mb_per_h:g} MB/hour over the window "
          f"and its last half"
          + (f"; failing: {', '.join(v.failing)}" if v.failing else "")
          + (f"; not judged: {', '.join(v.not_judged)}" if v.not_judged else "") + ")")
    if tq["logged"]:
        print(f"TransferQueue rows held: max {tq['rows_held_max']}, final {tq['rows_held_final']}, first-half max "
              f"{tq['rows_held_max_first_half']}, second-half max {tq['rows_held_max_second_half']} "
              f"({tq['rows_per_step']} rows/step): {'bounded' if tq['bounded'] else 'GROWING'}")
    else:
        print(f"TransferQueue rows held: not measured: {tq['note']}")
    print(f"RL steps {an['steps']}; errors {an['errors']} (exit {an['rc']}; "
          + "; ".join(f"{k}: {lg['tracebacks']} tracebacks, {lg['error_lines']} error lines"
                      for k, lg in an["logs"].items()) + ")")
    for k, lg in an["logs"].items():
        for e in lg["examples"]:
            print(f"  {k}: {e}")
    for n in an["notes"]:
        print(f"note: {n}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="RL time budget in minutes (default 30)")
    p.add_argument("--quick", action="store_true",
                   help="about 4 minutes in all: 3 minutes of RL after at most 100 warm-up steps, a 2 s interval")
    p.add_argument("--interval", type=float, default=None, help="seconds between RSS samples (default 5; 2 quick)")
    p.add_argument("--settle", type=float, default=None, help="share of the RL time left out of the fit (default 0.2)")
    p.add_argument("--target", type=float, default=TARGET_MB_PER_H, metavar="MB_PER_H",
                   help=f"the verdict fails if any process's RSS slope, over the fit window or its last half, "
                        f"reaches this (default {TARGET_MB_PER_H:g})")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: a new temp dir)")
    p.add_argument("--no-record", action="store_true", help="do not append a section to perf/RESULTS.md")
    p.add_argument("--reanalyse", type=Path, default=None, metavar="DIR",
                   help="no run: the figures of an earlier soak's out dir again (with --settle, --target, --no-record)")
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to `asyncflow train`")
    a = p.parse_args(argv)
    if a.target <= 0:
        p.error(f"--target must be > 0 MB/hour, got {a.target:g}")
    if a.reanalyse is not None:
        return reanalyse(a.reanalyse.resolve(), a.settle, record_it=not a.no_record, target=a.target)
    quick = []
    if a.quick:  # a capped warm-up: its length grows with the machine's load, the soak measures RL
        a.minutes = 3.0
        quick = ["warmup.max_steps=100"]
    interval = a.interval if a.interval is not None else (2.0 if a.quick else 5.0)
    a.settle = 0.2 if a.settle is None else a.settle
    if a.minutes <= 0 or interval <= 0 or not 0 <= a.settle < 1:
        p.error("--minutes and --interval must be > 0, --settle in [0, 1)")
    try:
        check_overrides(a.overrides, OWNED_KEYS)
    except ValueError as e:
        p.error(str(e))
    if not Path("/proc/self/status").is_file():
        raise SystemExit("perf/soak.py reads /proc: it runs on Linux only")
    out = (a.out or Path(tempfile.mkdtemp(prefix="asyncflow-soak-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir} is not empty: one directory holds one run; pass a new --out")
    budget = a.minutes * 60
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", "workflow.mode=async",
           f"trainer.time_budget_s={budget:g}", "trainer.steps=10000000", "trainer.progress=false",
           *quick, *a.overrides, f"trainer.out_dir={run_dir}"]
    # the run's own start-up, warm-up, evaluations and export come on top of the budget
    deadline = budget * 1.5 + 900
    print(f"soak: {' '.join(cmd[1:])}\n  out {out}; RSS every {interval:g} s; about {a.minutes + 1:.0f} min",
          flush=True)
    # `kill` or `timeout` on this script must not leave the run going in its own session
    signal.signal(signal.SIGTERM, _interrupt)
    res = run_and_sample(cmd, out, run_dir, interval, deadline)
    info = {"rc": res["rc"], "killed": res["killed"], "wall_s": res["wall_s"], "minutes": a.minutes,
            "interval": interval, "settle": a.settle, "load_end": os.getloadavg()[0],
            "cmd_line": " ".join(["python perf/soak.py", *(sys.argv[1:] if argv is None else argv)])}
    (out / "run.json").write_text(json.dumps(info, indent=2))  # what --reanalyse needs besides the files
    return report(out, res["samples"], info, record_it=not a.no_record, target=a.target)


def reanalyse(out: Path, settle: float | None, record_it: bool, target: float = TARGET_MB_PER_H) -> int:
    """The figures of an earlier soak again, from its out dir (rss.jsonl, run/, run.json or soak.json)."""
    if not (out / "rss.jsonl").is_file():
        raise SystemExit(f"--reanalyse {out}: no rss.jsonl there")
    if (out / "run.json").is_file():
        info = json.loads((out / "run.json").read_text())
    elif (out / "soak.json").is_file():
        r = json.loads((out / "soak.json").read_text())["result"]
        info = {"rc": r["exit_code"], "killed": r["killed"], "wall_s": r["wall_s"], "minutes": None,
                "interval": None, "settle": 0.2, "cmd_line": f"python perf/soak.py --reanalyse {out}"}
    else:
        raise SystemExit(f"--reanalyse {out}: neither run.json nor soak.json says how the run ended")
    if settle is not None:
        info["settle"] = settle
    samples = read_jsonl(out / "rss.jsonl")
    if info["interval"] is None and len(samples) > 1:  # only for the record line
        info["interval"] = round((samples[-1]["t_s"] - samples[0]["t_s"]) / (len(samples) - 1), 1)
    if info["minutes"] is None and (out / "run" / "config.json").is_file():
        info["minutes"] = json.loads((out / "run" / "config.json").read_text())["trainer"]["time_budget_s"] / 60
    return report(out, samples, info, record_it, target)


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def process_results(mem: dict, late: dict) -> dict[str, dict[str, Any]]:
    """Per process for the JSON line: slope, window start/end (minutes since launch), verdict."""
    out = {}
    for name, p in mem["processes"].items():
        lp = late["processes"].get(name)
        out[name] = {"pid": p.pid, "roles": p.roles, "slope_mb_per_h": _round(p.slope_mb_per_h),
                     "window_min": [round(p.t_from / 60, 2), round(p.t_to / 60, 2)], "samples": p.samples,
                     "verdict": p.verdict, "why": p.why,
                     "slope_mb_per_h_last_half": _round(lp.slope_mb_per_h if lp else None),
                     "verdict_last_half": lp.verdict if lp else NOT_JUDGED,
                     "anon_slope_mb_per_h": _round(p.anon_slope_mb_per_h), "rss_mb_end": round(p.rss_mb_end, 1)}
    return out


def _json_default(o: Any) -> Any:
    """soak.json holds the analysis as is: its records (dataclasses) as plain dicts."""
    if is_dataclass(o) and not isinstance(o, type):
        return {**asdict(o), **({"met": o.met} if isinstance(o, MemoryVerdict) else {})}
    return str(o)


def report(out: Path, samples: list[dict], info: dict, record_it: bool, target: float = TARGET_MB_PER_H) -> int:
    """Analyse, print the table, draw the plot, record, and print the JSON line last."""
    res = {"rc": info["rc"], "killed": info["killed"], "samples": samples}
    an = analyse(res, out, out / "run", info["settle"], target)
    an.update({"rc": info["rc"], "killed": info["killed"], "settle": info["settle"], "wall_s": info["wall_s"]})
    print_table(an)
    png = None
    if samples:
        try:
            png = plot(samples, an, out / "rss.png")
            print(f"RSS plot: {png}")
        except Exception as e:  # noqa: BLE001 - the figures stand without the plot
            print(f"RSS plot: not drawn ({type(e).__name__}: {e})")
    if record_it:
        record(an, info["cmd_line"], info["minutes"], info["interval"], load_end=info.get("load_end"))
        print(f"recorded in {RESULTS_MD}")
    mem, tq, late = an["memory"], an["tq"], an["memory_last_half"]
    v: MemoryVerdict = mem["verdict"]
    result = {
        "verdict": v.verdict, "target_mb_per_h": v.target_mb_per_h, "target_met": v.met, "failing": v.failing,
        "not_judged": v.not_judged, "processes": process_results(mem, late),
        "fit_window_min": [round(an["window"][0] / 60, 2), round(an["window"][1] / 60, 2)],
        "samples_in_window": mem["samples"],
        "steps": an["steps"], "errors": an["errors"], "exit_code": info["rc"], "killed": info["killed"],
        # for reference only: the sum can hide one process's climb behind another's release
        "sum_slope_mb_per_h": _round(mem["total"]), "sum_anon_slope_mb_per_h": _round(mem["total_anon"]),
        "sum_slope_mb_per_h_last_half": _round(late["total"]),
        "tq_rows_held_max": tq.get("rows_held_max"), "tq_rows_held_final": tq.get("rows_held_final"),
        "tq_bytes_held_max": tq.get("bytes_held_max"), "tq_bytes_held_final": tq.get("bytes_held_final"),
        "tq_rows_bounded": tq.get("bounded"), "tq_logged": tq["logged"],
        "reward_errors": an["reward_errors"], "reward_timeouts": an["reward_timeouts"],
        "wall_s": round(info["wall_s"], 1), "out": str(out),
        "png": str(png) if png else None,
    }
    (out / "soak.json").write_text(json.dumps({"result": result, "analysis": an}, indent=2, default=_json_default))
    print(json.dumps(result))
    # a soak passes only when the run ended well and every process's memory was judged under the target
    return 0 if info["rc"] == 0 and not info["killed"] and v.met else 1


if __name__ == "__main__":
    sys.exit(main())
