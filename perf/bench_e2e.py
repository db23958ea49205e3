"""End-to-end RL throughput, the paper's experiment side by side in one run.

The same GRPO job (reference and reward stages: ``algorithm.kl_coef=0.01``), model (the
built-in tiny model, not warmed up), task (addition), batch (prompts x group size), seed
and number of steps runs four times, one after another, each as its own
``python -m asyncflow.cli train grpo ...`` subprocess on the 2 local CPU ranks:

  sync_colocated  workflow.mode=sync, placement.mode=colocated (the verl-style baseline:
                  every role on both ranks, one stage after the other)
  sync            workflow.mode=sync, disaggregated (actor rank 0, rollout rank 1)
  stream          workflow.mode=stream, disaggregated (micro-batches flow as soon as ready)
  async           workflow.mode=async, max_staleness 1, disaggregated

The three disaggregated modes share one placement: actor and reward on rank 0, rollout
and the reference model on rank 1 (``placement.ref_with=rollout``). With the reference
beside the actor, the actor rank carried update + reference + weight publish while the
rollout rank idled about half of each async step; beside the rollout it balances the two
ranks. Every mode makes the same rollout calls: ``--batch-prompts`` prompts each (default
16, the GRPO recipe's default and the whole step here; sync always asks for the whole step).

and then TRL's GRPOTrainer as a peer (perf/_trl_peer.py, run with its own venv,
perf/.venv-trl, made here on first use) on the same model, prompts, batch, group size
and completion length. TRL has no per-row budgets: its completions stop at EOS or at
max_completion_length, so with the untrained model they run longer than the long-tailed
AsyncFlow rows; the JSON gives the ratio by samples/s and by tokens/s.

Workload: ``rollout.length_profile=longtail``. Each row gets its own token budget, a
seeded lognormal draw capped at ``rollout.max_new_tokens`` (median ~15% of the cap, ~3%
of rows at it); the untrained tiny model rarely emits EOS, so rows mostly run to their
budget: most responses short, a few near the limit, as reasoning rollouts are. Every
mode trains the same rows (dynamic sampling off), with the same per-row seeds.

Per mode the table shows samples/s and tokens/s over the RL phase (summary.json), each
stage's busy seconds per step (the sum of ``timing_s/<stage>`` over the steps of
metrics.jsonl, divided by the steps; ``weight_sync`` is the actor rank's publish spans
from timeline.jsonl, which per-step metrics do not carry), the idle ratio per role,
staleness mean/max and the ideal throughput bound from those measured stage costs:

  sync (either placement): the stages of a step run one after another, so a step costs
      at least its stages' costs added up:  bound = rows_per_step / sum_s c_s
  stream / async (overlapped): each group of ranks works through its own stages; stages
      on the same ranks add up, groups on different ranks overlap, so the busiest group
      sets the pace:  bound = rows_per_step / max_g sum_{s on g} c_s
      disaggregated: g = actor ranks [0] (update, reward with reward_with=actor,
      ref_log_prob with ref_with=actor, the weight_sync publish) and rollout ranks [1]
      (rollout, and ref_log_prob with ref_with=rollout);
      colocated: one group holding every stage (the bound equals the sync one).

where c_s is stage s's measured busy seconds per step. "Add up" counts once the time in
which two stages of a group ran at the same moment: the executor runs reward and
ref_log_prob concurrently (both only need the rollout), on one core, so each call's wall
time also holds the other's work and a plain sum would count it twice. The sum for a
group is therefore taken as the union of its stages' spans in timeline.jsonl, per step
(results.json also keeps the plain-sum bound, ``bound_summed_samples_per_s``). The
efficiency is samples/s divided by the bound: how close the run comes to perfect overlap
of its own measured costs (pipeline fill and drain, driver and TransferQueue overhead,
and stages that contend for a core are what it loses).

It writes, under --out (default perf/out/bench_e2e/): each run's output directory,
reward_curves.png (reward/mean against samples seen and against wall time, async
beside sync) and results.json. The last line printed is one JSON object.

    python perf/bench_e2e.py [--quick] [--out DIR] [--no-trl]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TORCH = "2.13.0"
TRANSFORMERS = "5.24.0"
TRL = "1.16.0"
TRL_VENV = ROOT / "perf" / ".venv-trl"

MODES = {
    "sync_colocated": ["workflow.mode=sync", "placement.mode=colocated"],
    "sync": ["workflow.mode=sync", "placement.mode=disaggregated"],
    "stream": ["workflow.mode=stream", "placement.mode=disaggregated"],
    "async": ["workflow.mode=async", "workflow.max_staleness=1", "placement.mode=disaggregated"],
}
# Where the reference model sits in every disaggregated mode (see the docstring); --ref-with overrides it.
REF_WITH = "rollout"
OVERLAPPED = ("stream", "async")
STAGES = ("rollout", "reward", "ref_log_prob", "update", "weight_sync")


def common_overrides(a: argparse.Namespace) -> list[str]:
    return [
        "algorithm.kl_coef=0.01", "algorithm.dynamic_sampling=false",
        *(["warmup.enabled=false"] if not a.warmup_steps else
          ["warmup.enabled=true", f"warmup.max_steps={a.warmup_steps}", f"warmup.check_every={a.warmup_steps}",
           "warmup.target_accuracy=1.1"]),  # exactly warmup_steps supervised steps, the same in every mode
        "trainer.time_budget_s=0", f"trainer.steps={a.steps}", "trainer.eval_every=0", "trainer.progress=false",
        f"trainer.prompts_per_step={a.prompts}", f"rollout.n={a.group}", f"rollout.batch_prompts={a.batch_prompts}",
        f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.length_profile=longtail",
        f"trainer.seed={a.seed}", f"trainer.threads={a.threads}", f"data.num_eval={a.num_eval}",
    ]


def placement_overrides(mode: list[str], a: argparse.Namespace) -> list[str]:
    """The shared placement of the disaggregated modes (colocated puts every role everywhere)."""
    if "placement.mode=disaggregated" not in mode:
        return []
    return [f"placement.ref_with={a.ref_with}"]


# ---- one AsyncFlow run ----------------------------------------------------------------------

def run_mode(name: str, a: argparse.Namespace, out: Path) -> dict:
    """Run one mode as its own `asyncflow train` subprocess (one retry on failure)."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *common_overrides(a), *MODES[name],
           *placement_overrides(MODES[name], a), f"trainer.out_dir={run_dir}"]
    err = ""
    for attempt in (1, 2):
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        t0 = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=a.run_timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.monotonic() - t0
        if rc == 0 and (run_dir / "summary.json").is_file():
            res = analyse(run_dir, name, a)
            res.update({"wall_s": wall, "attempts": attempt})
            return res
        err = f"exit {rc} after {wall:.0f} s (log: {out / (name + '.log')}): {tail(out / (name + '.log'))}"
        print(f"  {name}: attempt {attempt} failed, {err}", flush=True)
    return {"error": err}


def tail(path: Path, n: int = 3) -> str:
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    hits = [x for x in lines if "exits:" in x or "Error" in x or "error" in x]
    return " | ".join((hits or lines)[-n:])[-400:]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def union_s(spans: list[dict]) -> float:
    """Seconds covered by at least one of the spans."""
    total, end = 0.0, float("-inf")
    for s0, e0 in sorted((s["start"], s["end"]) for s in spans):
        if s0 > end:
            total += e0 - s0
            end = e0
        elif e0 > end:
            total += e0 - end
            end = e0
    return total


def analyse(run_dir: Path, name: str, a: argparse.Namespace) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_m = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "perf/samples_per_s" in m]
    n_steps = max(len(steps_m), 1)
    stage_s = {}
    for key in {k for m in steps_m for k in m if k.startswith("timing_s/")}:
        stage_s[key[len("timing_s/"):]] = sum(m.get(key, 0.0) for m in steps_m) / n_steps
    # The weight sync is timed after its step's metrics are logged: take the actor rank's
    # publish spans from the timeline (the rollout side's receive overlaps its generation).
    config = json.loads((run_dir / "config.json").read_text())
    disagg = config["placement"]["mode"] == "disaggregated"
    actor0 = config["placement"]["actor_ranks"][0] if disagg else 0
    spans = read_jsonl(run_dir / "timeline.jsonl")
    ws = sum(s["end"] - s["start"] for s in spans if s["stage"] == "weight_sync" and s["lane"] == f"rank{actor0} actor")
    stage_s["weight_sync"] = ws / n_steps
    rows_per_step = a.prompts * a.group
    # Which stages share ranks: disaggregated, the rollout ranks run rollout (and reward with
    # reward_with=rollout); the actor ranks run everything else. Colocated: one group, every stage.
    if disagg:
        rollout_side = ({"rollout"} | ({"reward"} if config["placement"]["reward_with"] == "rollout" else set())
                        | ({"ref_log_prob"} if config["placement"].get("ref_with") == "rollout" else set()))
        groups = {"actor_ranks": [k for k in stage_s if k not in rollout_side],
                  "rollout_ranks": [k for k in stage_s if k in rollout_side]}
        lanes = {"actor_ranks": {f"rank{r}" for r in config["placement"]["actor_ranks"]},
                 "rollout_ranks": {f"rank{r}" for r in config["placement"]["rollout_ranks"]}}
    else:
        groups = {"all_ranks": list(stage_s)}
        lanes = {"all_ranks": {s["lane"].split()[0] for s in spans}}
    if name not in OVERLAPPED:  # sync: the stages of a step run one after another, on whatever ranks
        groups = {"serial": list(stage_s)}
        lanes = {"serial": {s["lane"].split()[0] for s in spans}}
    # A group's cost per step: its stages' costs added up, counting once the time in which two of
    # them ran at the same moment (reward and ref_log_prob run concurrently on the actor rank:
    # sharing one core, each one's wall time holds the other's work). That is the union of the
    # spans of those stages on the group's ranks (timeline.jsonl), per step.
    group_s = {g: union_s([s for s in spans if s["stage"] in st and s["lane"].split()[0] in lanes[g]
                           and (s["stage"] != "weight_sync" or s["lane"].endswith(" actor"))]) / n_steps
               for g, st in groups.items()}
    summed = {g: sum(stage_s[k] for k in st) for g, st in groups.items()}
    bound = rows_per_step / max(max(group_s.values()), 1e-9)
    bound_summed = rows_per_step / max(max(summed.values()), 1e-9)
    occupancy = {r: union_s([s for s in spans if s["lane"].split()[0] == r]) / n_steps
                 for r in sorted({s["lane"].split()[0] for s in spans})}
    lengths = sorted(len(json.loads(x)["response_ids"]) for x in (run_dir / "samples.jsonl").read_text().splitlines()
                     if x.strip()) if (run_dir / "samples.jsonl").is_file() else []
    sps = summary["samples_per_s"]
    return {
        "samples_per_s": sps, "tokens_per_s": summary["tokens_per_s"], "rl_s": summary["rl_s"],
        "steps": summary["rl_steps"], "rows": summary["rl_steps"] * rows_per_step,
        "stage_s_per_step": stage_s, "group_s_per_step": group_s, "group_summed_s_per_step": summed,
        "rank_busy_s_per_step": occupancy, "bound_summed_samples_per_s": bound_summed,
        "idle_ratio": summary.get("idle_ratio", {}), "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"], "bound_samples_per_s": bound, "efficiency": sps / bound,
        "response_len": {"mean": statistics.fmean(lengths) if lengths else 0.0,
                         "p50": lengths[len(lengths) // 2] if lengths else 0,
                         "p90": lengths[int(len(lengths) * 0.9)] if lengths else 0,
                         "max": lengths[-1] if lengths else 0,
                         "at_cap": sum(x >= a.max_new_tokens for x in lengths) / max(len(lengths), 1)},
        # t: seconds since the RL phase began (the first step's end less its duration)
        "reward_curve": [{"samples": (i + 1) * rows_per_step, "reward": m.get("reward/mean"),
                          "t": m["time_s"] - steps_m[0]["time_s"] + steps_m[0].get("step_time_s", 0.0)}
                         for i, m in enumerate(steps_m)],
    }


# ---- the TRL peer ---------------------------------------------------------------------------

def trl_python() -> Path:
    return TRL_VENV / "bin" / "python"


def trl_ready() -> bool:
    py = trl_python()
    if not py.is_file():
        return False
    check = (f"import trl, transformers, torch; assert trl.__version__ == {TRL!r}; "
             f"assert transformers.__version__ == {TRANSFORMERS!r}; assert torch.__version__.startswith({TORCH!r})")
    return subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0


def ensure_trl_venv(log_path: Path) -> str | None:
    """Make perf/.venv-trl (TRL pinned to the CPU torch) unless it already works; None or the error."""
    if trl_ready():
        return None
    print(f"  making the TRL venv {TRL_VENV} (trl=={TRL}, transformers=={TRANSFORMERS}, torch=={TORCH}) ...",
          flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={TORCH}\n")
        constraints = f.name
    pip = [str(TRL_VENV / "bin" / "pip"), "install", "-q"]
    steps = [[sys.executable, "-m", "venv", str(TRL_VENV)], [*pip, f"torch=={TORCH}"],
             [*pip, "-c", constraints, f"trl=={TRL}", f"transformers=={TRANSFORMERS}", "datasets", "accelerate"]]
    with open(log_path, "w") as log:
        for cmd in steps:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                return f"TRL venv: `{' '.join(cmd)}` failed ({rc}); see {log_path}"
    os.unlink(constraints)
    return None if trl_ready() else f"TRL venv made but trl {TRL} / transformers {TRANSFORMERS} do not import"


def run_trl(a: argparse.Namespace, out: Path) -> dict:
    err = ensure_trl_venv(out / "trl_install.log")
    if err:
        return {"error": err}
    from asyncflow.config import load_config
    from asyncflow.data.addition import addition_record
    from asyncflow.data.run_data import build_prompt_data
    from asyncflow.trainer import resolve_model

    # The prompts the AsyncFlow runs trained on: the first steps x prompts of the same stream.
    cfg = load_config(ROOT / "recipes" / "grpo" / "config.yaml", common_overrides(a))
    model = resolve_model(cfg)
    it = build_prompt_data(cfg, model).train_records()
    recs = [next(it) for _ in range(a.steps * a.prompts)]
    spec = {"model": model, "prompts": [addition_record(int(r["index"]))["prompt"] for r in recs],
            "answers": [str(r["answer"]) for r in recs], "steps": a.steps, "prompts_per_step": a.prompts,
            "group_size": a.group, "max_completion_length": a.max_new_tokens, "beta": cfg.algorithm.kl_coef,
            "lr": cfg.optim.lr, "temperature": cfg.rollout.temperature, "seed": a.seed, "threads": a.trl_threads,
            "out_dir": str(out / "trl")}
    spec_path, res_path = out / "trl_spec.json", out / "trl_result.json"
    spec_path.write_text(json.dumps(spec))
    res_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(out / "trl.log", "w") as log:
        try:
            rc = subprocess.run([str(trl_python()), str(ROOT / "perf" / "_trl_peer.py"), str(spec_path),
                                 str(res_path)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=a.run_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not res_path.is_file():
        return {"error": f"TRL run exit {rc} (log: {out / 'trl.log'}): {tail(out / 'trl.log')}"}
    res = json.loads(res_path.read_text())
    res["wall_s"] = time.monotonic() - t0
    return res


# ---- report ---------------------------------------------------------------------------------

def plot(results: dict, path: Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    style = {"async": ("tab:red", "-"), "sync_colocated": ("tab:blue", "-"), "sync": ("tab:blue", "--"),
             "stream": ("tab:green", ":")}
    for name, (color, ls) in style.items():
        r = results.get(name, {})
        curve = [p for p in r.get("reward_curve", []) if p["reward"] is not None]
        if not curve:
            continue
        left.plot([p["samples"] for p in curve], [p["reward"] for p in curve], ls, color=color, marker=".",
                  label=name)
        right.plot([p["t"] for p in curve], [p["reward"] for p in curve], ls, color=color, marker=".", label=name)
    flat = all(p["reward"] == 0 for r in results.values() for p in r.get("reward_curve", []))
    if flat:
        fig.suptitle("reward/mean is 0 throughout: the tiny model is not warmed up (--warmup-steps N)")
    left.set(xlabel="samples seen", ylabel="reward/mean", title="reward per sample")
    right.set(xlabel="RL wall time (s)", ylabel="reward/mean", title="reward against time")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(x: dict, y: dict) -> float | None:
    if "samples_per_s" not in x or "samples_per_s" not in y or not y["samples_per_s"]:
        return None
    return round(x["samples_per_s"] / y["samples_per_s"], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 steps; finishes within ~5 minutes on 2 cores")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "bench_e2e"))
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default 16 quick, 32 full): the "
                    "overlapped modes' pipeline fill and drain (a rollout before the first update, an update "
                    "after the last rollout) weigh on their samples/s as about one step in 'steps'")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    ap.add_argument("--ref-with", choices=("actor", "rollout"), default=REF_WITH,
                    help="disaggregated modes: the ranks the reference model shares")
    ap.add_argument("--batch-prompts", type=int, default=16,
                    help="prompts per rollout call in stream/async (sync: the whole step per call)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="the length cap of the long tail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per AsyncFlow rank (2 ranks)")
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (1 process)")
    ap.add_argument("--num-eval", type=int, default=16, help="held-out prompts of the before/after evaluation")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="supervised warm-up steps before RL, the same in every mode (default 0: the untrained "
                         "model rarely ends a row early, which the long tail needs, but then earns no reward; "
                         "a warmed model learns to stop, so its rewards move and its lengths shrink); "
                         "the TRL peer always starts from the untrained model")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL peer")
    ap.add_argument("--run-timeout-s", type=float, default=1200.0)
    a = ap.parse_args()
    if a.steps is None:
        a.steps = 16 if a.quick else 32
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = a.prompts * a.group
    print(f"workload: GRPO + reference (kl_coef 0.01) + reward, tiny model ({a.warmup_steps} warm-up steps), "
          f"addition task; "
          f"{a.steps} steps x {a.prompts} prompts x {a.group} = {rows} rows/step; long-tailed budgets "
          f"capped at {a.max_new_tokens} tokens; rollout calls of {a.batch_prompts} prompts (stream/async); "
          f"disaggregated: reference with the {a.ref_with} rank",
          flush=True)
    results: dict[str, dict] = {}
    for name in [m for m in a.modes.split(",") if m]:
        if name not in MODES:
            raise SystemExit(f"--modes: unknown mode {name!r}; known: {', '.join(MODES)}")
        print(f"running {name} ...", flush=True)
        results[name] = run_mode(name, a, out)
    if not a.no_trl:
        print("running TRL GRPOTrainer peer ...", flush=True)
        try:
            results["trl"] = run_trl(a, out)
        except Exception as e:  # noqa: BLE001 - reported, never faked
            results["trl"] = {"error": f"{type(e).__name__}: {e}"}

    print()
    print(f"{'mode':15} {'samples/s':>9} {'tokens/s':>9} {'bound':>7} {'eff':>5} {'stale':>9} "
          + " ".join(f"{s[:9]:>9}" for s in STAGES) + "  idle ratio per role")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:15} FAILED: {r['error']}")
            continue
        if name == "trl":
            print(f"{name:15} {r['samples_per_s']:9.2f} {fmt(r.get('tokens_per_s'), '9.1f'):>9} {'-':>7} {'-':>5} "
                  f"{'-':>9} (TRL {r['trl_version']}, train {r['train_s']:.1f} s, completion length mean "
                  f"{fmt(r.get('completion_len_mean'), '.1f')}, max {r.get('completion_len_max')})")
            continue
        st = r["stage_s_per_step"]
        idle = " ".join(f"{k}={v:.2f}" for k, v in sorted(r["idle_ratio"].items()))
        print(f"{name:15} {r['samples_per_s']:9.2f} {r['tokens_per_s']:9.1f} {r['bound_samples_per_s']:7.2f} "
              f"{r['efficiency']:5.2f} {r['staleness_mean']:4.2f}/{r['staleness_max']:<4.0f} "
              + " ".join(f"{st.get(s, 0.0):9.2f}" for s in STAGES) + f"  {idle}")
    print("(stage columns: busy seconds per step; bound: ideal samples/s from those costs, see the docstring; "
          "eff = samples/s / bound; stale = staleness mean/max)")
    for name, r in results.items():
        if "response_len" in r:
            L = r["response_len"]
            print(f"  {name}: response length mean {L['mean']:.1f}, p50 {L['p50']}, p90 {L['p90']}, max {L['max']}, "
                  f"{100 * L['at_cap']:.1f}% at the cap; rank busy s/step "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["rank_busy_s_per_step"].items())
                  + f"; run wall {r['wall_s']:.0f} s")
    png = None
    try:
        png = plot(results, out / "reward_curves.png")
        print(f"reward curves: {png}")
    except Exception as e:  # noqa: BLE001
        print(f"reward curves: not drawn ({type(e).__name__}: {e})")
    sync, asy = results.get("sync_colocated", {}), results.get("async", {})
    trl = results.get("trl", {})
    summary = {
        "samples_per_s": {k: round(v["samples_per_s"], 3) for k, v in results.items() if "samples_per_s" in v},
        "tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in results.items()
                         if v.get("tokens_per_s") is not None},
        "bound_samples_per_s": {k: round(v["bound_samples_per_s"], 3) for k, v in results.items()
                                if "bound_samples_per_s" in v},
        "efficiency_vs_bound": {k: round(v["efficiency"], 3) for k, v in results.items() if "efficiency" in v},
        "ratio_stream_vs_sync": ratio(results.get("stream", {}), sync),
        "ratio_async_vs_sync": ratio(asy, sync),
        "ratio_async_vs_sync_disaggregated": ratio(asy, results.get("sync", {})),
        "ratio_async_vs_trl": ratio(asy, trl),
        "async_efficiency_vs_bound": round(asy["efficiency"], 3) if "efficiency" in asy else None,
        "staleness": {k: [round(v["staleness_mean"], 3), v["staleness_max"]] for k, v in results.items()
                      if "staleness_mean" in v},
        "target_ratio_async_vs_sync_1.6_met": None,
        "target_async_efficiency_0.85_met": None,
        "ratio_async_vs_trl_tokens": (round(asy["tokens_per_s"] / trl["tokens_per_s"], 3)
                                      if asy.get("tokens_per_s") and trl.get("tokens_per_s") else None),
        "trl": ({"error": trl["error"]} if "error" in trl else
                {k: trl.get(k) for k in ("samples_per_s", "tokens_per_s", "trl_version", "completion_len_mean")}),
        "errors": {k: v["error"] for k, v in results.items() if "error" in v},
        "steps": a.steps, "rows_per_step": rows, "max_new_tokens": a.max_new_tokens,
        "reward_png": str(png) if png else None, "wall_s": round(time.monotonic() - t0, 1),
    }
    if summary["ratio_async_vs_sync"] is not None:
        summary["target_ratio_async_vs_sync_1.6_met"] = summary["ratio_async_vs_sync"] >= 1.6
    if summary["async_efficiency_vs_bound"] is not None:
        summary["target_async_efficiency_0.85_met"] = summary["async_efficiency_vs_bound"] >= 0.85
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": results, "args": vars(a)}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
