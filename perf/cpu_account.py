"""The CPU of one RL step by component, AsyncFlow's and TRL's, at 1x, 4x and 16x the rows per step.

    python perf/cpu_account.py [--scales 1,4,16] [--steps-before 8] [--steps N] [--no-trl] [KEY=VALUE ...]

The workload is perf/bench_e2e.py's (GRPO on addition from its shared warm-up, ``--prompts``
x ``--group`` rows per step at 1x, the reference and reward stages), AsyncFlow in the main
job's mode and placement (async, disaggregated, its default threads and reward placement;
KEY=VALUE overrides go to AsyncFlow's runs only, a variant to account, e.g.
``transfer_queue.service=driver``), TRL's GRPOTrainer (perf/_trl_peer.py through
perf/_trl_account.py, one process, ``--trl-threads`` torch threads) on the same prompts. Each
scale multiplies the prompts per step.

How CPU is attributed: every thread of every process of the run is read from /proc (its CPU
over a window of RL steps after ``--steps-before``: ``--steps``, or by default about as many
rows at every scale, ``window_steps``); inside a thread, code under
an ``asyncflow.cpu_account`` span (enabled by ``ASYNCFLOW_CPU_ACCOUNT``) is charged to the
span's component, and the rest of the thread to the component its name says
(``thread_component``). AsyncFlow's processes write their spans, open ones counted up to the
moment, and their Python threads' CPU clocks to files every 0.5 s; each file's change over the
window is scaled to the window (``scale_to_window``), so a Python thread's total and its spans
come from the same moments (other threads, libzmq's and torch's, from /proc). TRL's window is
read in its process at the steps' ends.

Prints, for each of our runs, the cores it kept busy (CPU a step over wall a step: near the
machine's cores the step is bound by its CPU), a table per scale (CPU ms per step and per row,
by component, both sides), then the fixed and per-row parts of each component (least squares
over the scales: ms per step = fixed + per_row x rows); the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PERF = Path(__file__).resolve().parent
ROOT = PERF.parent
sys.path.insert(0, str(PERF))
sys.path.insert(0, str(ROOT))

import bench_e2e  # noqa: E402
import soak  # noqa: E402
from run_overrides import check_overrides  # noqa: E402
from thread_cpu import cpu_by_thread  # noqa: E402

FILE_PREFIX = "cpu_account-"  # asyncflow.cpu_account's snapshot files
# The default window: this many RL steps at 1x, proportionally fewer at larger scales (about
# the same rows, so about the same seconds, at every scale). A window of a few seconds lets
# one slow moment of a shared machine move a run's whole account.
WINDOW_STEPS_1X = 144
MIN_WINDOW_STEPS = 6

# A thread's CPU outside any span goes to the component its name says; the first rule whose
# process label starts with its first field ("*": any) and whose thread name contains its
# second wins.
THREAD_RULES: tuple[tuple[str, str, str], ...] = (
    ("tq_service", "", "tq_process"),  # the TransferQueue's own process: controller + storage unit
    ("*", "tq-service", "tq_process"),  # the same in a rank's thread (transfer_queue.service=driver)
    ("*", "tq-unit-", "tq_process"),  # a node's storage unit in its local rank 0 (storage_units=per_node)
    ("*", "ZMQbg/", "zmq_io"),  # libzmq's I/O threads (every socket's bytes, RPC and TransferQueue)
    ("*", "GarbageCollectorThread", "zmq_io"),  # pyzmq's: frees buffers sent without a copy
    ("*", "gloo", "weight_sync"),  # torch.distributed's gloo threads: the weight broadcasts
    ("*", "tensorboard", "logging"),  # the TensorBoard logger's writer thread
    ("*", "tqdm_monitor", "logging"),
    ("*", "rollout-", "generation"),  # rollout-rankN-service: the engine's loop (-writer: see below)
    ("*", "reward-", "reward"),  # the reward runner's threads
    ("*", "worker-control-", "rpc"),
    ("*", "driver-watchdog-", "rpc"),
    ("*", "worker-rank", "rpc"),  # rank 0's call loop (the actor's work is in spans)
    ("rank0", "MainThread", "driver_loop"),  # the driver's event loop (rank 0)
    ("rank0", "asyncio_", "driver_loop"),  # the loop's executor: driver stages run there
    ("rank", "MainThread", "rpc"),  # a rank's call loop (its calls' work is in spans)
    ("rank", "worker-", "rpc"),  # concurrent calls (a rollout's submit, in spans)
    ("trl", "MainThread", "driver_loop"),  # the Trainer's loop
    ("launcher", "", "launcher"),
    ("resource_tracker", "", "launcher"),
)
# the keys this script sets for each run (a window of steps after a warm-up of steps), and how to set them
OWNED_KEYS = {"trainer.seed": "--seed", "trainer.out_dir": "--out", "trainer.steps": "--steps, --steps-before",
              "trainer.time_budget_s": "--steps"}
WRITER_SUFFIX = "-writer"  # a rollout's TransferQueue writer thread
COMPONENT_ORDER = ("update", "generation", "rollout_submit", "reward", "ref_log_prob", "old_log_prob",
                   "weight_sync", "driver_loop", "rpc", "zmq_io", "tq_client", "tq_process", "serialization",
                   "logging", "account", "launcher", "other")
CONTROL_PLANE = ("driver_loop", "rpc", "zmq_io", "tq_client", "tq_process", "serialization", "logging")


# ---- pure functions -------------------------------------------------------------------------

def thread_component(process: str, thread: str) -> str:
    """The component a thread's unspanned CPU goes to, from its process label and name."""
    if thread.startswith("rollout-") and thread.endswith(WRITER_SUFFIX):
        return "tq_client"
    for proc, part, component in THREAD_RULES:
        if (proc == "*" or process.startswith(proc)) and part in thread:
            return component
    return "other"


def scale_to_window(before: Mapping[str, int], after: Mapping[str, int], factor: float) -> dict[str, float]:
    """A thread's span totals over the window: their change between two snapshots, times
    ``factor`` (the window's length over the snapshots' interval)."""
    return {c: (ns - before.get(c, 0)) * factor for c, ns in after.items() if ns - before.get(c, 0) > 0}


def attribute(threads: Mapping[str, tuple[str, str, float]], spans: Mapping[str, Mapping[str, float]]
              ) -> dict[str, float]:
    """ns by component. ``threads``: key -> (process label, thread name, ns on CPU in the
    window); ``spans``: the same key -> {component: ns in spans}. A thread's spans are scaled
    down when they exceed its CPU (snapshots a little off the window), and its remainder goes
    to ``thread_component``."""
    out: dict[str, float] = {}
    for key, (process, name, total) in threads.items():
        charged = dict(spans.get(key, {}))
        in_spans = sum(charged.values())
        if in_spans > total > 0:
            charged = {c: ns * total / in_spans for c, ns in charged.items()}
            in_spans = total
        for c, ns in charged.items():
            out[c] = out.get(c, 0.0) + ns
        rest = total - in_spans
        if rest > 0:
            home = thread_component(process, name)
            out[home] = out.get(home, 0.0) + rest
    return out


def per_step(ns_by_component: Mapping[str, float], steps: int) -> dict[str, float]:
    """CPU ms per step by component, in COMPONENT_ORDER, with the total."""
    ms = {c: ns_by_component[c] / steps / 1e6 for c in _ordered(ns_by_component)}
    ms["total"] = sum(ms.values())
    ms["control_plane"] = sum(ms.get(c, 0.0) for c in CONTROL_PLANE)
    return ms


def cores_busy(cpu_ms_per_step: float, window_s: float, steps: int) -> float:
    """Cores the run kept busy over its window: CPU a step over wall time a step. Near the
    machine's cores, the step is bound by its CPU (only less CPU a step makes it faster); well
    under, by waits between stages (overlap could)."""
    if steps <= 0 or window_s <= 0:
        raise ValueError(f"cores_busy needs a window of steps: {steps} steps in {window_s} s")
    return cpu_ms_per_step / (window_s * 1e3 / steps)


def _ordered(keys: Sequence[str] | Mapping[str, object]) -> list[str]:
    keys = list(keys)
    return [c for c in COMPONENT_ORDER if c in keys] + sorted(c for c in keys if c not in COMPONENT_ORDER)


def fixed_and_per_row(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of ms per step = fixed + per_row x rows over (rows, ms) points:
    (fixed ms per step, ms per row)."""
    if len({r for r, _ in points}) < 2:
        raise ValueError(f"fixed and per-row parts need at least two row counts, got {list(points)}")
    n = len(points)
    mx = sum(r for r, _ in points) / n
    my = sum(m for _, m in points) / n
    sxx = sum((r - mx) ** 2 for r, _ in points)
    slope = sum((r - mx) * (m - my) for r, m in points) / sxx
    return my - slope * mx, slope


def table(accounts: Mapping[str, Mapping[str, float]], rows: Mapping[str, int]) -> str:
    """Markdown: one row per component, two columns (ms per step, us per row) per account."""
    names = list(accounts)
    comps = _ordered({c for a in accounts.values() for c in a if c not in ("total", "control_plane")})
    head = "| component | " + " | ".join(f"{n} ms/step | {n} us/row" for n in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    for c in [*comps, "control_plane", "total"]:
        cells = []
        for n in names:
            ms = accounts[n].get(c, 0.0)
            cells += [f"{ms:.1f}", f"{ms / rows[n] * 1e3:.0f}"]
        label = f"**{c}**" if c in ("control_plane", "total") else c
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- AsyncFlow ------------------------------------------------------------------------------

def _metrics_rows(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _snapshots(directory: Path) -> dict[int, dict]:
    out = {}
    for p in directory.glob(f"{FILE_PREFIX}*.json"):
        try:
            snap = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # replaced meanwhile: the rename is atomic, a read may still race the unlink
        out[int(snap["pid"])] = snap
    return out


def _wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _metrics_rows(path) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before {n} steps in {path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {n} steps in {path} within {timeout_s:.0f} s")
        time.sleep(0.05)


def account_asyncflow(overrides: list[str], run_dir: Path, before: int, steps: int, timeout_s: float) -> dict:
    """One `asyncflow train grpo` with the account on: CPU ns by component over ``steps`` steps."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    acct_dir = run_dir / "cpu_account"
    acct_dir.mkdir(parents=True)
    metrics = run_dir / "out" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *overrides, f"trainer.out_dir={run_dir / 'out'}"]
    env = {**os.environ, "ASYNCFLOW_CPU_ACCOUNT": str(acct_dir), "PYTHONPATH": str(ROOT)}
    with open(run_dir / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            sampler = soak.Sampler(proc.pid)
            _wait_rows(metrics, before, proc, timeout_s)
            labels = {pid: v["label"] for pid, v in sampler.sample().items()}
            n0, t0 = _metrics_rows(metrics), time.monotonic()
            c0, s0 = cpu_by_thread(set(labels)), _snapshots(acct_dir)
            _wait_rows(metrics, n0 + steps, proc, timeout_s)
            n1, t1 = _metrics_rows(metrics), time.monotonic()
            c1, s1 = cpu_by_thread(set(labels)), _snapshots(acct_dir)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    threads: dict[str, tuple[str, str, float]] = {}
    spans: dict[str, dict[str, float]] = {}
    calls: dict[str, float] = {}  # requests served per step, by server and method
    for pid, snap in s1.items():
        if pid in s0 and snap["time"] > s0[pid]["time"]:
            factor = (t1 - t0) / (snap["time"] - s0[pid]["time"]) / max(n1 - n0, 1)
            for what, n in scale_to_window(s0[pid].get("counts", {}), snap.get("counts", {}), factor).items():
                calls[what] = calls.get(what, 0.0) + n
    for (pid, tid), (os_name, sec) in c1.items():
        snap = s1.get(pid)
        name = (snap or {}).get("threads", {}).get(str(tid), os_name)
        key = f"{pid}:{tid}"
        total = (sec - c0.get((pid, tid), (os_name, 0.0))[1]) * 1e9
        if snap is not None and pid in s0 and snap["time"] > s0[pid]["time"]:
            factor = (t1 - t0) / (snap["time"] - s0[pid]["time"])
            spans[key] = scale_to_window(s0[pid]["spans"].get(str(tid), {}), snap["spans"].get(str(tid), {}), factor)
            before, after = s0[pid].get("cpu", {}).get(str(tid)), snap.get("cpu", {}).get(str(tid))
            if before is not None and after is not None:  # a Python thread: its clock read with its spans
                total = (after - before) * factor
        threads[key] = (labels.get(pid, "other"), name, total)
    detail = {k: {"process": p, "thread": n, "ms_per_step": round(ns / max(n1 - n0, 1) / 1e6, 2),
                  "spans_ms_per_step": {c: round(v / max(n1 - n0, 1) / 1e6, 2) for c, v in spans.get(k, {}).items()}}
              for k, (p, n, ns) in threads.items() if ns > 0}
    (run_dir / "threads.json").write_text(json.dumps(detail, indent=1))
    return {"steps": n1 - n0, "window_s": t1 - t0, "ns": attribute(threads, spans),
            "processes": sorted(set(labels.values())), "calls_per_step": calls}


# ---- TRL ------------------------------------------------------------------------------------

def account_trl(spec: dict, python: Path, run_dir: Path, before: int, steps: int, threads: int,
                timeout_s: float) -> dict:
    """TRL's run through perf/_trl_account.py: CPU ns by component over ``steps`` steps."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec = {**spec, "steps": before + steps, "threads": threads, "out_dir": str(run_dir / "trainer"),
            "use_vllm": False, "account_from": before, "account_to": before + steps}
    spec_path, result, window = run_dir / "spec.json", run_dir / "result.json", run_dir / "window.json"
    spec_path.write_text(json.dumps(spec))
    with open(run_dir / "run.log", "w") as log:
        rc = bench_e2e.run_group([str(python), str(PERF / "_trl_account.py"), str(spec_path), str(result),
                                  str(window)], log, timeout_s)
    if rc != 0 or not window.is_file():
        raise RuntimeError(f"the TRL run failed (exit {rc}); see {run_dir / 'run.log'}")
    w = json.loads(window.read_text())
    threads_ns = {tid: ("trl", name, float(ns)) for tid, (name, ns) in w["threads"].items()}
    return {"steps": w["steps"], "ns": attribute(threads_ns, w["spans"]),
            "rl_s": json.loads(result.read_text()).get("rl_s")}


# ---- main -----------------------------------------------------------------------------------

def trl_interpreter(venv: str, out: Path) -> Path:
    """TRL's python: ``venv``'s, or bench_e2e's venv, made here if it is missing or broken."""
    if venv:
        python = Path(venv) / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"cpu_account: --trl-venv {venv} has no bin/python; leave it out to use (and make) "
                             f"{bench_e2e.TRL_VENV}, or pass --no-trl")
        return python
    failed = bench_e2e.ensure_trl_venv(out / "trl_install.log")
    if failed:
        raise SystemExit(f"cpu_account: the TRL venv {bench_e2e.TRL_VENV} could not be made: {failed} "
                         f"(log: {out / 'trl_install.log'}); pass --no-trl to account ours alone")
    return bench_e2e.trl_python()


def window_steps(scales: Sequence[int], steps: int | None, only_scale_steps: str = "") -> list[int]:
    """RL steps in each scale's window: ``only_scale_steps`` (one per scale), else ``steps`` at
    every scale, else ``WINDOW_STEPS_1X / scale`` (at least ``MIN_WINDOW_STEPS``)."""
    if only_scale_steps:
        per = [int(x) for x in only_scale_steps.split(",")]
        if len(per) != len(scales):
            raise ValueError(f"--only-scale-steps gives {len(per)} windows for {len(scales)} scales {list(scales)}: "
                             "give one per scale")
        return per
    if steps is not None:
        return [steps] * len(scales)
    return [max(MIN_WINDOW_STEPS, round(WINDOW_STEPS_1X / s)) for s in scales]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,4,16", help="multiples of --prompts per step")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step at 1x (bench_e2e's default)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--batch-prompts", type=int, default=16, help="rollout.batch_prompts (bench_e2e's default)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--steps-before", type=int, default=8, help="RL steps before the window")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"RL steps in the window at every scale (default: {WINDOW_STEPS_1X} / scale, at least "
                         f"{MIN_WINDOW_STEPS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-threads", type=int, default=1, help="torch threads of TRL's process")
    ap.add_argument("--trl-venv", default="",
                    help="a venv with trl (bench_e2e's pins); default bench_e2e's perf/.venv-trl, made on first use")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides for AsyncFlow's runs")
    ap.add_argument("--only-scale-steps", default="", help="per-scale window steps, e.g. 24,12,4")
    ap.add_argument("--out", default=str(PERF / "out" / "cpu_account"))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    a = ap.parse_args()
    try:
        check_overrides(a.overrides, OWNED_KEYS)
    except ValueError as e:
        ap.error(str(e))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scales = [int(s) for s in a.scales.split(",")]
    try:
        windows = window_steps(scales, a.steps, a.only_scale_steps)
    except ValueError as e:
        ap.error(str(e))
    ns = argparse.Namespace(seed=a.seed, num_eval=256, fresh_warmup=False, run_timeout_s=a.timeout_s,
                            prompts=a.prompts, group=a.group, batch_prompts=a.batch_prompts,
                            max_new_tokens=a.max_new_tokens, lengths="natural", steps=0, lr=bench_e2e.DEFAULT_LR)
    model = Path(bench_e2e.warm_up(ns, out)["model"])
    trl_python = trl_interpreter(a.trl_venv, out) if not a.no_trl else Path()
    accounts: dict[str, dict[str, float]] = {}
    rows: dict[str, int] = {}
    calls: dict[str, dict[str, float]] = {}
    busy: dict[str, float] = {}  # ours: CPU a step over wall a step, over the window
    by_side: dict[str, list[tuple[int, dict[str, float]]]] = {"ours": [], "trl": []}
    for scale, steps in zip(scales, windows):
        ns.prompts, ns.steps = a.prompts * scale, a.steps_before + steps + 4
        n_rows = ns.prompts * a.group
        overrides = [*bench_e2e.workload_overrides(ns), *bench_e2e.start_from(model), *bench_e2e.MODES["async"],
                     *a.overrides]
        ours = account_asyncflow(overrides, out / f"ours_x{scale}", a.steps_before, steps, a.timeout_s)
        name = f"ours x{scale}"
        accounts[name], rows[name] = per_step(ours["ns"], ours["steps"]), n_rows
        by_side["ours"].append((n_rows, accounts[name]))
        calls[name] = {k: round(v, 2) for k, v in sorted(ours["calls_per_step"].items(), key=lambda kv: -kv[1])}
        busy[name] = round(cores_busy(accounts[name]["total"], ours["window_s"], ours["steps"]), 2)
        print(f"{name}: {ours['steps']} steps in {ours['window_s']:.1f} s ({busy[name]:.2f} cores busy), "
              f"processes {ours['processes']}; "
              f"requests served per step: {sum(calls[name].values()):.1f} ({calls[name]})", flush=True)
        if not a.no_trl:
            ns.steps = a.steps_before + steps
            trl = account_trl(bench_e2e.trl_spec(ns, model), trl_python, out / f"trl_x{scale}", a.steps_before,
                              steps, a.trl_threads, a.timeout_s)
            name = f"trl x{scale}"
            accounts[name], rows[name] = per_step(trl["ns"], trl["steps"]), n_rows
            by_side["trl"].append((n_rows, accounts[name]))
            print(f"{name}: {trl['steps']} steps", flush=True)
    print()
    print("CPU per RL step by component (ms per step, us per row):")
    print(table(accounts, rows))
    fits: dict[str, dict[str, list[float]]] = {}
    for side, points in by_side.items():
        if len({r for r, _ in points}) < 2:
            continue
        comps = _ordered({c for _, acc in points for c in acc})
        fits[side] = {}
        for c in comps:
            fixed, per_row = fixed_and_per_row([(r, acc.get(c, 0.0)) for r, acc in points])
            fits[side][c] = [round(fixed, 2), round(per_row * 1e3, 1)]
    if fits:
        print()
        print("Fixed ms per step and us per row (least squares over the scales):")
        sides = list(fits)
        print("| component | " + " | ".join(f"{s} fixed ms | {s} us/row" for s in sides) + " |")
        print("|---|" + "---|---|" * len(sides))
        for c in _ordered({c for f in fits.values() for c in f}):
            cells = [f"{fits[s][c][0]:.1f} | {fits[s][c][1]:.0f}" if c in fits[s] else "- | -" for s in sides]
            print(f"| {c} | " + " | ".join(cells) + " |")
    print(json.dumps({"accounts": {n: {c: round(v, 2) for c, v in acc.items()} for n, acc in accounts.items()},
                      "rows_per_step": rows, "fixed_ms_and_us_per_row": fits, "requests_per_step": calls,
                      "cores_busy": busy,
                      "overrides": list(a.overrides), "code": bench_e2e.code_version()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
