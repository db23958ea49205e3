"""Convergence of sync vs async GRPO: reward and held-out accuracy against samples seen.

Runs ``asyncflow train grpo`` as subprocesses, one after another, for three settings:

  sync       workflow.mode=sync
  async_s1   workflow.mode=async workflow.max_staleness=1
  async_s2   workflow.mode=async workflow.max_staleness=2

with the same seed, the same RL step count (``trainer.steps``, ``trainer.time_budget_s=0``,
so the same prompt budget: ``trainer.prompts_per_step`` prompts per step) and the same
evaluation cadence. The warm-up is identical for all: by default (``--warmup shared``) it
runs once, in a run with ``trainer.steps=0``, and every setting starts RL from its
exported weights (``model.path=.../hf_model warmup.enabled=false``); ``--warmup each``
lets every run do the default warm-up itself (deterministic given the seed, slower). The
script checks that every setting starts from the same held-out accuracy.

Everything reported is MEASURED from the runs' files; nothing is modelled:
  - samples seen = cumulative rows trained (``samples.jsonl``, one line per trained row;
    dynamic sampling drops all-equal groups, so rows per step vary);
  - ``reward/mean`` per RL step (``metrics.jsonl``), plotted at the samples seen after the step;
  - ``eval/accuracy`` (greedy, held-out): ``before_rl``, every ``trainer.eval_every`` steps
    (``rl``) and ``after_rl``, plotted at the samples the evaluated policy version
    (``eval/version``: the policy after that many updates) had trained on;
  - wall seconds of each subprocess and the RL seconds from ``summary.json``.
The 2-core VM is shared and noisy: seconds move by +-30% between runs; the learning
curves are deterministic only up to the asynchrony's timing (which rows train with which
policy version depends on timing in async mode).

    python perf/convergence.py [--quick] [--out perf/out/convergence] [--steps N] [key=value ...]

Extra ``key=value`` arguments go to every run. Writes ``convergence.png`` and one run
directory per setting into ``--out``; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "sync": ["workflow.mode=sync"],
    "async_s1": ["workflow.mode=async", "workflow.max_staleness=1"],
    "async_s2": ["workflow.mode=async", "workflow.max_staleness=2"],
}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def train(run_dir: Path, overrides: list[str], log_name: str = "train.log") -> tuple[int, float, Path]:
    """One ``asyncflow train grpo`` subprocess into a fresh ``run_dir``: (exit code, wall s, log)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # one directory holds one run (the HF export refuses to overwrite)
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.{log_name}"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *overrides, f"trainer.out_dir={run_dir}"]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - t0, log


def curves(run_dir: Path) -> dict:
    """Reward and accuracy against samples seen, from one finished run's files."""
    metrics = _jsonl(run_dir / "metrics.jsonl")
    rows_per_step: dict[int, int] = {}
    for r in _jsonl(run_dir / "samples.jsonl"):  # "step" is the 0-based RL step; metrics count from 1
        rows_per_step[r["step"]] = rows_per_step.get(r["step"], 0) + 1
    steps = [m for m in metrics if "phase" not in m and "reward/mean" in m]
    last = max([m["step"] for m in steps] + [max(rows_per_step, default=-1) + 1, 0])
    cum = [0]  # cum[v]: rows trained by updates 0..v-1, i.e. seen by policy version v
    for t in range(last):
        cum.append(cum[-1] + rows_per_step.get(t, 0))
    reward = [(cum[m["step"]], m["reward/mean"], m["step"]) for m in steps]
    evals = []
    for m in metrics:
        if "eval/accuracy" in m and m.get("phase") in ("before_rl", "rl", "after_rl"):
            v = int(m.get("eval/version", m["step"] if m["phase"] != "before_rl" else 0))
            evals.append((cum[min(max(v, 0), last)], m["eval/accuracy"], m["phase"], v))
    sft = [(m["step"], round(m["sft/loss"], 6)) for m in metrics if m.get("phase") == "sft" and "sft/loss" in m]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {"reward": reward, "evals": evals, "samples": cum[-1], "steps": len(steps), "summary": summary, "sft": sft}


def stats(c: dict) -> dict:
    rewards = [r[1] for r in c["reward"]]
    tail = rewards[-max(1, math.ceil(0.2 * len(rewards))):] if rewards else []
    before = [e[1] for e in c["evals"] if e[2] == "before_rl"]
    after = [e[1] for e in c["evals"] if e[2] == "after_rl"]
    return {
        "accuracy_before": before[0] if before else float("nan"),
        "final_accuracy": after[-1] if after else float("nan"),
        "best_accuracy": max((e[1] for e in c["evals"] if e[2] != "before_rl"), default=float("nan")),
        "reward_last20": sum(tail) / len(tail) if tail else float("nan"),
        "samples": c["samples"], "steps": c["steps"],
        "staleness_mean": c["summary"].get("staleness_mean", float("nan")),
        "rl_s": c["summary"].get("rl_s", float("nan")),
    }


def plot(all_curves: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (name, c) in enumerate(all_curves.items()):
        color = f"C{i}"
        if c["reward"]:
            xs = [r[0] for r in c["reward"]]
            ys = [r[1] for r in c["reward"]]
            w = max(1, len(ys) // 15)  # moving average over ~1/15 of the run
            sm = [sum(ys[max(0, j - w + 1):j + 1]) / len(ys[max(0, j - w + 1):j + 1]) for j in range(len(ys))]
            a1.plot(xs, ys, color=color, alpha=0.2, lw=0.8)
            a1.plot(xs, sm, color=color, lw=1.8, label=f"{name} (moving mean of {w})")
        if c["evals"]:
            ev = sorted(c["evals"])
            a2.plot([e[0] for e in ev], [e[1] for e in ev], "-o", color=color, ms=3, label=name)
    a1.set_title("reward/mean per RL step", fontsize=10)
    a2.set_title("held-out greedy accuracy (eval/accuracy)", fontsize=10)
    for a in (a1, a2):
        a.set_xlabel("samples seen (rows trained)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short runs: 30 steps of 16 prompts, warm-up of at most 100 steps (~6 min on an idle "
                         "2-core VM, ~12 min on a loaded one)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "convergence"))
    ap.add_argument("--steps", type=int, default=0, help="RL steps per setting (default 400, --quick 30)")
    ap.add_argument("--eval-every", type=int, default=0, help="RL steps between evaluations (default 20, --quick 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", choices=["shared", "each"], default="shared",
                    help="shared: warm up once and start every setting from those weights; each: every run warms up")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of " + ",".join(SETTINGS))
    ap.add_argument("overrides", nargs="*", help="key=value, passed to every run")
    args = ap.parse_args(argv)
    steps = args.steps or (30 if args.quick else 400)
    every = args.eval_every or (10 if args.quick else 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"trainer.seed={args.seed}", f"trainer.steps={steps}", "trainer.time_budget_s=0",
              f"trainer.eval_every={every}", "trainer.progress=false", "trainer.log_samples=true"]
    if args.quick:  # a short warm-up, half-size steps, a smaller held-out set: a smoke-scale comparison
        common += ["warmup.target_accuracy=0.1", "warmup.check_every=50", "warmup.max_steps=100",
                   "trainer.prompts_per_step=16", "rollout.batch_prompts=8", "data.num_eval=128"]
    common += list(args.overrides)
    t_all = time.monotonic()

    warm: dict = {}
    start_from: list[str] = []
    if args.warmup == "shared":
        wdir = out / "warmup"
        rc, wall, log = train(wdir, [*common, "trainer.steps=0", "trainer.eval_every=0"])
        if rc != 0 or not (wdir / "hf_model").exists():
            print(f"warm-up run failed (exit {rc}); see {log}:\n" + log.read_text()[-3000:], file=sys.stderr)
            return 1
        summ = json.loads((wdir / "summary.json").read_text())
        warm = {"warmup_steps": summ.get("warmup_steps"), "accuracy": summ.get("eval_accuracy_after_rl"),
                "wall_s": round(wall, 1)}
        print(f"warm-up: {warm['warmup_steps']} supervised steps, held-out accuracy {warm['accuracy']:.3f}, "
              f"{wall:.0f} s", flush=True)
        # the exported policy (eager attention, as the built-in model) is every setting's start
        start_from = [f"model.path={(wdir / 'hf_model').resolve()}", "model.attn_implementation=eager",
                      "warmup.enabled=false"]

    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    all_curves, results, walls, failed = {}, {}, {}, {}
    for name in names:
        rc, wall, log = train(out / name, [*common, *start_from, *SETTINGS[name]])
        if rc != 0:
            failed[name] = f"exit {rc}, see {log}"
            print(f"{name}: FAILED (exit {rc}); last lines of {log}:\n" + log.read_text()[-2000:], flush=True)
            continue
        c = curves(out / name)
        all_curves[name] = c
        results[name] = {**stats(c), "wall_s": wall}
        walls[name] = wall
        r = results[name]
        print(f"{name}: {r['steps']} steps, {r['samples']} rows trained, accuracy {r['accuracy_before']:.3f} -> "
              f"{r['final_accuracy']:.3f}, {wall:.0f} s", flush=True)

    if all_curves:
        png = out / "convergence.png"
        plot(all_curves, png, f"GRPO on the addition task, seed {args.seed}, {steps} RL steps each "
                              f"({'shared' if args.warmup == 'shared' else 'per-run'} warm-up)")
        print(f"plot: {png}")
    print(f"\n{'setting':9} {'acc before':>10} {'final acc':>9} {'best acc':>8} {'reward last20%':>14} "
          f"{'samples':>8} {'steps':>5} {'stale':>5} {'RL s':>6} {'wall s':>6}")
    for name, r in results.items():
        print(f"{name:9} {r['accuracy_before']:>10.3f} {r['final_accuracy']:>9.3f} {r['best_accuracy']:>8.3f} "
              f"{r['reward_last20']:>14.3f} {r['samples']:>8} {r['steps']:>5} {r['staleness_mean']:>5.2f} "
              f"{r['rl_s']:>6.0f} {r['wall_s']:>6.0f}")
    before = {round(r["accuracy_before"], 6) for r in results.values()}
    sft = {json.dumps(c["sft"]) for c in all_curves.values()}
    identical = len(before) <= 1 and len(sft) <= 1
    if not identical:
        print("WARNING: the settings did not start from the same warmed-up policy "
              f"(before_rl accuracies {sorted(before)})")
    diffs = {}
    if "sync" in results:
        s = results["sync"]
        for name, r in results.items():
            if name != "sync":
                diffs[name] = {"final_accuracy": round(r["final_accuracy"] - s["final_accuracy"], 4),
                               "best_accuracy": round(r["best_accuracy"] - s["best_accuracy"], 4),
                               "reward_last20": round(r["reward_last20"] - s["reward_last20"], 4),
                               "wall_ratio_vs_sync": round(r["wall_s"] / s["wall_s"], 3)}
    summary = {
        "settings": {n: {"final_accuracy": round(r["final_accuracy"], 4), "best_accuracy": round(r["best_accuracy"], 4),
                         "reward_last20": round(r["reward_last20"], 4), "samples": r["samples"],
                         "wall_s": round(r["wall_s"], 1)} for n, r in results.items()},
        "async_minus_sync": diffs, "start_accuracy": sorted(before)[0] if before else None,
        "same_start": identical, "steps": steps, "eval_every": every, "seed": args.seed, "warmup": args.warmup,
        **({"warmup_run": warm} if warm else {}), **({"failed": failed} if failed else {}),
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
