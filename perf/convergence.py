"""Sync vs async GRPO over several seeds: time to a held-out accuracy, and learning at equal samples.

The measurement that decides the main job's default mode. It runs ``asyncflow train grpo`` as
subprocesses, one after another, for these settings (``--settings``; the first two by default):

  sync            workflow.mode=sync; otherwise the main job's defaults (disaggregated, reward
                  beside the rollout, threads auto: torch's default in sync disaggregated)
  async           no override: the main job as shipped (async, max_staleness 1, in-flight
                  updates off, decoupled PPO, one thread per rank)
  async_partial   async with ``rollout.partial_rollout=true`` (new weights swapped in at the
                  next decode step instead of once the running batch has drained)
  async_s2        async with ``workflow.max_staleness=2``

Method. For every seed of ``--seeds`` (default 0,1,2; ``--quick`` 0,1):
  1. one warm-up run (``trainer.steps=0``, the seed's supervised warm-up) exports ``hf_model``;
  2. every setting of that seed starts RL from those weights (``model.path=... warmup.enabled=false``)
     with the same seed, the same stop (``--steps`` RL steps, the same prompt budget; or with
     ``--time-budget S`` the same S RL seconds, ``trainer.time_budget_s``, the fair stop for time
     to accuracy: equal steps give the faster setting less time) and evaluation cadence
     (``--eval-every`` steps); the script checks they all start from the same held-out accuracy;
  3. the settings run in a rotating order: the seed at position i of ``--seeds`` starts with the
     i-th setting and wraps around (A B C, B C A, C A B, ...); with as many seeds as settings (or
     a multiple) each setting runs in each position equally often, otherwise the printed orders
     show which ran first how often.

Figures, all MEASURED from the runs' files (nothing modelled), per run:
  - time to accuracy (perf/time_to_accuracy.py): for each of ``--thresholds`` (default 0.5, 0.6,
    0.7), the RL seconds and the samples (rows trained) until the first policy version whose
    held-out greedy accuracy met it had been trained; never reached is reported as such;
  - ``samples_per_s`` (``summary.json``'s RL phase) and RL steps/s; rows trained per step
    (dynamic sampling drops all-equal groups, so rows per step depend on the policy);
  - held-out accuracy and reward at EQUAL SAMPLES: per seed, S = the fewest rows any setting of
    that seed trained; the accuracy of each setting's last evaluated version trained on at most S
    rows, and its mean per-step reward over the last fifth of those S rows; held-out accuracy at
    equal RL time likewise (T = the shortest RL phase of the seed);
  - final and best held-out accuracy, ``collapsed`` (the last evaluation below the start);
  - per-step diagnostics, averaged over the run: staleness, the decoupled loss's importance
    weight and its capped fraction, the clip fraction, entropy, gradient norm, response length.
Per setting, each figure is reported as its median over the seeds and its spread (min, max).

Headline:
  - ``ratio_time_to_acc_async_vs_sync``: at the highest threshold that every seed of both sync and
    async reached (``time_to_acc_threshold``), per seed sync's RL seconds over async's (> 1: async
    got there sooner); the median and range of those ratios; ``reached`` says how many seeds of
    each setting reached each threshold.
  - ``ceiling_steps_ratio``: the most async could gain in RL steps/s on this machine, from stage
    costs measured alone: per seed, sync's seconds per step over the busiest rank group's
    seconds per step in the same sync run (its stages run one after another there, so each
    group's spans are its cost without overlap; perf/bench_e2e.py's bound); beside it async's
    measured ``ratio_async_vs_sync_steps_per_s``. With equal learning per step, the time-to-
    accuracy ratio cannot exceed that ceiling.
  - ``accuracy_within_noise`` / ``reward_within_noise``: async's median at equal samples lies
    within [min, max] of sync's per-seed values (inclusive; meaningful with several seeds).

The 2-core VM is shared and noisy (seconds move by +-30% between runs); the learning curves are
deterministic only up to the asynchrony's timing (which rows train on which policy version).

    python perf/convergence.py [--quick] [--seeds 0,1,2] [--steps N] [--settings a,b]
                               [--thresholds 0.5,0.6,0.7] [key=value ...]

Extra ``key=value`` arguments go to every run (not ``trainer.seed``: use ``--seeds``). Writes into
``--out``: one directory per seed (``seed<k>/warmup``, ``seed<k>/<setting>`` and their logs),
``results.json`` (every figure and curve) and ``convergence.png``. The last printed line is one
JSON object with the per-setting medians and spreads, the ratios, the seeds, the steps and the
command-line overrides.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import group_costs, rank_groups, rotation  # the e2e bench's order and bound
from run_overrides import check_overrides
from time_to_accuracy import (
    THRESHOLDS,
    Reach,
    VersionPoint,
    accuracy_at,
    collapsed,
    first_reach,
    highest_reached_by_all,
    parse_thresholds,
    reached_counts,
    reward_at,
    rl_start_s,
    step_times,
    steps_to_reward,
    time_ratios,
    version_points,
    version_time,
)

ROOT = Path(__file__).resolve().parent.parent
# The async settings name the main job's own values explicitly, so a changed recipe default
# cannot silently change what "async" measured.
SETTINGS: dict[str, tuple[str, ...]] = {
    "sync": ("workflow.mode=sync",),
    "async": ("workflow.mode=async", "workflow.max_staleness=1", "rollout.partial_rollout=false"),
    "async_partial": ("workflow.mode=async", "workflow.max_staleness=1", "rollout.partial_rollout=true"),
    "async_s2": ("workflow.mode=async", "workflow.max_staleness=2", "rollout.partial_rollout=false"),
}
DEFAULT_SETTINGS = ("sync", "async")
REFERENCE = "sync"
HEADLINE_RATIOS = {"ratio_async_vs_sync_samples_per_s": "async",
                   "ratio_async_s2_vs_sync_samples_per_s": "async_s2"}
NOISE_CANDIDATE = "async"
# training-reward levels (trailing mean over REWARD_WINDOW steps) whose step counts compare the
# settings' learning per step; the main job's reward starts near 0.25 after its warm-up
REWARD_LEVELS = (0.4, 0.5)
REWARD_WINDOW = 100
# Per seed, a short sync run at async's threads per rank (one) measures the stage costs alone
# for the ceiling; it is not a learning setting.
COSTS_RUN = "stage_costs"
COSTS_OVERRIDES = ("workflow.mode=sync", "trainer.threads=1", "trainer.eval_every=0")
# per-step metrics averaged over a run: why one setting learns differently per step
DIAGNOSTICS = ("async/staleness_mean", "actor/is_weight", "actor/is_capfrac", "actor/pg_clipfrac",
               "actor/entropy", "actor/grad_norm", "response_length/mean", "rollout_corr/logp_abs_diff_mean")
TAIL_FRACTION = 0.2
FIGURES = ("samples_per_s", "steps_per_s", "rows_per_step", "reward_last20", "final_accuracy", "best_accuracy",
           "accuracy_before", "staleness_mean", "samples", "rl_s")


# ---- pure logic ------------------------------------------------------------------------------------------------

def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]; distinct integers, at least one."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError(f"--seeds: no seed in {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: repeated seed in {text!r} (a repeat would reuse the warm-up directory)")
    return seeds


def parse_settings(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise ValueError(f"--settings: unknown or no settings {unknown or text!r}; known: {', '.join(SETTINGS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--settings: repeated setting in {text!r}")
    return names


# the keys this script sets for each run, and how to set them
OWNED_KEYS = {"trainer.seed": "--seeds", "trainer.out_dir": "--out"}


@dataclass(frozen=True)
class Spread:
    """A figure measured once per seed: its median over the seeds and its range."""

    median: float
    lo: float
    hi: float
    per_seed: dict[int, float]

    def as_json(self, digits: int = 4) -> dict:
        return {"median": round(self.median, digits), "min": round(self.lo, digits), "max": round(self.hi, digits),
                "per_seed": {str(s): round(v, digits) for s, v in self.per_seed.items()}}


def spread(per_seed: Mapping[int, float]) -> Spread:
    """Median and range over the seeds; NaN figures (e.g. no evaluation) are left out."""
    vals = {s: float(v) for s, v in per_seed.items() if not math.isnan(float(v))}
    if not vals:
        raise ValueError(f"spread: no values (every seed's figure failed or is NaN: {dict(per_seed)})")
    xs = list(vals.values())
    return Spread(statistics.median(xs), min(xs), max(xs), vals)


def maybe_spread(per_seed: Mapping[int, float]) -> Spread | None:
    """spread(), or None when no seed has a (non-NaN) value."""
    return spread(per_seed) if any(not math.isnan(float(v)) for v in per_seed.values()) else None


def per_seed_ratios(num: Mapping[int, float], den: Mapping[int, float]) -> dict[int, float]:
    """num[s] / den[s] for each seed measured in both (a failed run is absent) with den[s] > 0.

    The ratio is taken within a seed first: both runs share that seed's warm-up and ran close
    together in time, so machine-speed drift between seeds cancels out of it.
    """
    return {s: num[s] / den[s] for s in num if s in den and den[s] > 0}


def within_noise(value: float, reference: Spread) -> bool:
    """The rule for ``reward_within_noise``: value in [min, max] of the reference's per-seed values."""
    return reference.lo <= value <= reference.hi


def tail_mean(values: Sequence[float], fraction: float = TAIL_FRACTION) -> float:
    """Mean of the last ``fraction`` of values (at least one); NaN if there are none."""
    if not values:
        return float("nan")
    tail = values[-max(1, math.ceil(fraction * len(values))):]
    return sum(tail) / len(tail)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a .jsonl file; a bad line raises with the file and line number."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
    return rows


def cumulative_samples(rows_per_step: Mapping[int, int], steps: int) -> list[int]:
    """cum[v] = rows trained by updates 0..v-1, i.e. the samples policy version v has seen."""
    cum = [0]
    for t in range(steps):
        cum.append(cum[-1] + rows_per_step.get(t, 0))
    return cum


@dataclass(frozen=True)
class RewardPoint:
    samples: int  # rows trained up to and including this step
    reward: float  # reward/mean of the step's trained rows
    step: int  # 1-based RL step (as in metrics.jsonl)


@dataclass(frozen=True)
class EvalPoint:
    samples: int  # rows the evaluated policy version had trained on
    accuracy: float
    phase: str  # before_rl | rl | after_rl
    version: int


@dataclass(frozen=True)
class Curves:
    reward: list[RewardPoint]
    evals: list[EvalPoint]
    samples: int
    trained_steps: int  # RL steps that trained rows (dynamic sampling may drop a whole step's groups)
    points: list[VersionPoint]  # evaluated versions with the RL seconds at which each was trained
    diagnostics: dict[str, float]  # DIAGNOSTICS averaged over the steps that logged them


def run_means(steps: Sequence[Mapping], keys: Iterable[str]) -> dict[str, float]:
    """Each key's mean over the step rows that carry it (keys no row carries are left out)."""
    out = {}
    for k in keys:
        vals = [float(m[k]) for m in steps if k in m and not math.isnan(float(m[k]))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def read_curves(run_dir: Path) -> Curves:
    """Reward and accuracy against samples seen, from one finished run's metrics.jsonl and samples.jsonl."""
    mpath, spath = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    for p, why in ((mpath, "the run did not log metrics"), (spath, "run with trainer.log_samples=true")):
        if not p.is_file():
            raise ValueError(f"{run_dir}: no {p.name} ({why})")
    metrics = read_jsonl(mpath)
    rows_per_step: dict[int, int] = {}
    for r in read_jsonl(spath):  # "step" there is the 0-based RL step; metrics.jsonl counts from 1
        rows_per_step[r["step"]] = rows_per_step.get(r["step"], 0) + 1
    steps = [m for m in metrics if "phase" not in m and "reward/mean" in m]
    last = max([m["step"] for m in steps] + [max(rows_per_step, default=-1) + 1, 0])
    cum = cumulative_samples(rows_per_step, last)
    reward = [RewardPoint(cum[m["step"]], float(m["reward/mean"]), int(m["step"])) for m in steps]
    evals = []
    for m in metrics:
        if "eval/accuracy" in m and m.get("phase") in ("before_rl", "rl", "after_rl"):
            v = int(m.get("eval/version", 0 if m["phase"] == "before_rl" else m["step"]))
            evals.append(EvalPoint(cum[min(max(v, 0), last)], float(m["eval/accuracy"]), m["phase"], v))
    points = version_points(metrics, cum)
    return Curves(reward, evals, cum[-1], len(steps), points,  # a step without rows has no reward/mean row
                  run_means(steps, DIAGNOSTICS))


@dataclass(frozen=True)
class RunResult:
    samples_per_s: float
    reward_last20: float
    final_accuracy: float
    best_accuracy: float
    accuracy_before: float
    staleness_mean: float
    samples: int
    rl_steps: int
    trained_steps: int
    rl_s: float
    wall_s: float
    reaches: tuple[Reach, ...] = ()  # per threshold of the run's --thresholds
    collapsed: bool = False

    @property
    def steps_per_s(self) -> float:
        """RL steps per RL second: the speed of the system alone. samples/s is this times the rows
        per step, which dynamic sampling makes a property of the policy (how many groups it answers
        all alike), not of the system."""
        return self.rl_steps / self.rl_s if self.rl_s > 0 else float("nan")

    @property
    def rows_per_step(self) -> float:
        """Rows trained per RL step (after dynamic sampling's filter)."""
        return self.samples / self.rl_steps if self.rl_steps else float("nan")


def stage_group_costs(run_dir: Path) -> dict[str, float]:
    """Each rank group's busy seconds per RL step in a sync run, where a step's stages run one
    after another: the union of its stages' spans on its ranks (timeline.jsonl; the e2e bench's
    rule), i.e. the stage costs measured alone."""
    cfg = json.loads((run_dir / "config.json").read_text())
    if cfg["workflow"]["mode"] != "sync":
        raise ValueError(f"{run_dir}: stage costs are measured alone only in a sync run (mode "
                         f"{cfg['workflow']['mode']!r})")
    summ = json.loads((run_dir / "summary.json").read_text())
    spans = [x for x in read_jsonl(run_dir / "timeline.jsonl") if x.get("step", -1) >= 0]
    groups = rank_groups(cfg["placement"], {x["stage"] for x in spans}, {x["lane"].split()[0] for x in spans})
    return group_costs(spans, groups, int(summ["rl_steps"]))


def window_s_per_step(run_dir: Path, steps: int) -> float:
    """Seconds per RL step over a run's first ``steps`` steps (from its step rows' times)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    times = step_times(metrics, rl_start_s(metrics))
    return version_time(times, steps) / steps


@dataclass(frozen=True)
class Ceiling:
    """The most async could gain in RL steps/s on this machine, over RL steps 1..steps of a seed:
    the sync run's seconds per step over the busiest rank group's cost per step, measured alone
    (a sync run at async's threads per rank), beside what async measured over the same steps."""

    steps: int
    group_s_per_step: dict[str, float]
    sync_s_per_step: float
    async_s_per_step: float

    @property
    def ratio(self) -> float:
        worst = max(self.group_s_per_step.values(), default=0.0)
        return self.sync_s_per_step / worst if worst > 0 else float("nan")

    @property
    def measured(self) -> float:
        return self.sync_s_per_step / self.async_s_per_step

    @property
    def share(self) -> float:
        """How much of the ceiling's gain async reached: (measured - 1) / (ratio - 1)."""
        return (self.measured - 1) / (self.ratio - 1) if self.ratio > 1 else float("nan")


def ceiling_summary(ceilings: Mapping[int, Ceiling], steps: int) -> dict | None:
    """The ceilings of the seeds: median and range of the ratio, async's measured ratio over the
    same steps, and the share of the ceiling's gain async reached."""
    if not ceilings:
        return None
    return {"steps": steps,
            "ratio": spread({s: c.ratio for s, c in ceilings.items()}).as_json(3),
            "async_measured": spread({s: c.measured for s, c in ceilings.items()}).as_json(3),
            "share_of_gain": maybe_spread({s: c.share for s, c in ceilings.items()}).as_json(3)
            if maybe_spread({s: c.share for s, c in ceilings.items()}) else None,
            "group_s_per_step": {str(s): {g: round(v, 4) for g, v in c.group_s_per_step.items()}
                                 for s, c in ceilings.items()}}


def seed_ceiling(seed_dir: Path, steps: int) -> Ceiling:
    """The seed's ceiling from its stage-cost run and its sync and async runs."""
    return Ceiling(steps, stage_group_costs(seed_dir / COSTS_RUN), window_s_per_step(seed_dir / REFERENCE, steps),
                   window_s_per_step(seed_dir / NOISE_CANDIDATE, steps))


def run_result(curves: Curves, summary: Mapping, wall_s: float, where: str = "run",
               thresholds: Sequence[float] = THRESHOLDS) -> RunResult:
    """One run's figures from its curves and its summary.json."""
    if "samples_per_s" not in summary:
        raise ValueError(f"{where}: summary.json has no samples_per_s (keys: {sorted(summary)})")
    before = [e.accuracy for e in curves.evals if e.phase == "before_rl"]
    after = [e.accuracy for e in curves.evals if e.phase == "after_rl"]
    return RunResult(
        samples_per_s=float(summary["samples_per_s"]),
        reward_last20=tail_mean([p.reward for p in curves.reward]),
        final_accuracy=after[-1] if after else float("nan"),
        best_accuracy=max((e.accuracy for e in curves.evals if e.phase != "before_rl"), default=float("nan")),
        accuracy_before=before[0] if before else float("nan"),
        staleness_mean=float(summary.get("staleness_mean", float("nan"))),
        samples=curves.samples, rl_steps=int(summary.get("rl_steps", curves.trained_steps)),
        trained_steps=curves.trained_steps,
        rl_s=float(summary.get("rl_s", float("nan"))), wall_s=wall_s,
        reaches=tuple(first_reach(curves.points, thresholds)), collapsed=collapsed(curves.points))


def same_start(results: Mapping[str, Mapping[int, RunResult]]) -> dict[int, bool]:
    """Per seed: did every setting start RL at the same held-out accuracy (the shared warm-up)?"""
    by_seed: dict[int, set[float]] = {}
    for runs in results.values():
        for seed, r in runs.items():
            by_seed.setdefault(seed, set()).add(round(r.accuracy_before, 6))
    return {s: len(v) <= 1 for s, v in sorted(by_seed.items())}


def ratios_to_reference(results: Mapping[str, Mapping[int, RunResult]], figure: str) -> dict[str, dict]:
    """Per setting other than the reference, ``figure``'s ratio to the reference's, taken per seed
    then summarised (median and range); settings with no seed in common are left out."""
    ref = results.get(REFERENCE, {})
    out = {}
    for name, runs in results.items():
        r = per_seed_ratios({s: getattr(x, figure) for s, x in runs.items()},
                            {s: getattr(x, figure) for s, x in ref.items()})
        if name != REFERENCE and r:
            out[name] = spread(r).as_json(3)
    return out


def time_to_accuracy(results: Mapping[str, Mapping[int, RunResult]], thresholds: Sequence[float]) -> dict:
    """Per setting and threshold: RL seconds and samples to reach it (median and range over the
    seeds that reached it) and how many seeds did."""
    out: dict[str, dict] = {}
    for name, runs in results.items():
        per = {}
        for i, thr in enumerate(thresholds):
            got = {s: r.reaches[i] for s, r in runs.items() if len(r.reaches) > i and r.reaches[i].reached}
            per[f"{thr:g}"] = {
                "reached": len(got), "of": len(runs),
                "rl_s": spread({s: x.rl_s for s, x in got.items()}).as_json(1) if got else None,
                "samples": spread({s: x.samples for s, x in got.items()}).as_json(0) if got else None}
        if runs:
            out[name] = per
    return out


def equal_footing(results: Mapping[str, Mapping[int, RunResult]],
                  curves: Mapping[str, Mapping[int, Curves]]) -> dict[str, dict[str, Spread]]:
    """Per setting: held-out accuracy and reward at the samples every setting of the seed reached
    (the fewest any trained), and accuracy at the RL seconds every setting of the seed ran."""
    seeds = sorted({s for runs in results.values() for s in runs})
    out: dict[str, dict[str, dict[int, float]]] = {n: {"accuracy_at_equal_samples": {}, "reward_at_equal_samples": {},
                                                      "accuracy_at_equal_time": {}} for n in results}
    for seed in seeds:
        have = [n for n in results if seed in results[n] and seed in curves.get(n, {})]
        if len(have) < 2:
            continue
        n_samples = min(results[n][seed].samples for n in have)
        rl_s = min(results[n][seed].rl_s for n in have)
        for n in have:
            c = curves[n][seed]
            out[n]["accuracy_at_equal_samples"][seed] = accuracy_at(c.points, samples=n_samples)
            out[n]["reward_at_equal_samples"][seed] = reward_at([(p.samples, p.reward) for p in c.reward], n_samples)
            out[n]["accuracy_at_equal_time"][seed] = accuracy_at(c.points, rl_s=rl_s)
    return {n: {k: sp for k, v in figs.items() if (sp := maybe_spread(v)) is not None} for n, figs in out.items()}


def summarise(results: Mapping[str, Mapping[int, RunResult]], curves: Mapping[str, Mapping[int, Curves]] | None = None,
              thresholds: Sequence[float] = THRESHOLDS) -> dict:
    """Per setting, every figure's median and spread over the seeds; the ratios to sync per seed;
    time to accuracy; accuracy and reward at equal samples; the within-noise verdicts.
    ``results[setting][seed]`` holds the runs that finished, ``curves`` their curves."""
    settings = {}
    for name, runs in results.items():
        figs = {f: maybe_spread({s: getattr(r, f) for s, r in runs.items()}) for f in FIGURES}
        if runs:
            settings[name] = {f: sp.as_json() for f, sp in figs.items() if sp is not None}
    ref = results.get(REFERENCE, {})
    ratios, step_ratios = ratios_to_reference(results, "samples_per_s"), ratios_to_reference(results, "steps_per_s")
    noise = {}
    ref_reward = maybe_spread({s: x.reward_last20 for s, x in ref.items()})
    for name, runs in results.items():
        cand = maybe_spread({s: x.reward_last20 for s, x in runs.items()})
        if name != REFERENCE and cand is not None and ref_reward is not None:
            noise[name] = within_noise(cand.median, ref_reward)
    out = {"settings": settings, "ratios_vs_sync": ratios, "step_ratios_vs_sync": step_ratios}
    out.update({key: ratios.get(name) for key, name in HEADLINE_RATIOS.items()})
    # Beside the headline: how much of it is the system's speed (RL steps/s) and how much the rows
    # each policy's groups leave to train on.
    out["ratio_async_vs_sync_steps_per_s"] = step_ratios.get(NOISE_CANDIDATE)
    out["reward_within_noise"] = noise.get(NOISE_CANDIDATE)
    out["reward_within_noise_per_setting"] = noise
    out["reward_within_noise_rule"] = (f"{NOISE_CANDIDATE} median reward_last20 in [min, max] of "
                                       f"{REFERENCE}'s per-seed reward_last20")
    out.update(learning_verdict(results, curves or {}, thresholds))
    return out


def learning_verdict(results: Mapping[str, Mapping[int, RunResult]], curves: Mapping[str, Mapping[int, Curves]],
                     thresholds: Sequence[float]) -> dict:
    """Time to accuracy (the headline), learning at equal samples, collapses, the ceiling."""
    ref, cand = results.get(REFERENCE, {}), results.get(NOISE_CANDIDATE, {})
    tta = time_to_accuracy(results, thresholds)
    reach = {n: {s: r.reaches for s, r in runs.items()} for n, runs in results.items()}
    top = highest_reached_by_all(reach, thresholds, (REFERENCE, NOISE_CANDIDATE))
    ratio = None
    if top is not None:
        r = time_ratios(reach[REFERENCE], reach[NOISE_CANDIDATE], list(thresholds).index(top))
        ratio = spread(r).as_json(3) if r else None
    equal = equal_footing(results, curves)
    verdicts: dict[str, bool | None] = {}
    for key, fig in (("accuracy_within_noise", "accuracy_at_equal_samples"),
                     ("reward_at_equal_samples_within_noise", "reward_at_equal_samples")):
        a, b = equal.get(NOISE_CANDIDATE, {}).get(fig), equal.get(REFERENCE, {}).get(fig)
        verdicts[key] = within_noise(a.median, b) if a is not None and b is not None else None
    return {
        "time_to_accuracy": tta,
        "time_to_acc_threshold": top,
        "ratio_time_to_acc_async_vs_sync": ratio,
        "reached": {n: reached_counts(by_seed, thresholds) for n, by_seed in reach.items() if by_seed},
        "equal_footing": {n: {k: sp.as_json() for k, sp in figs.items()} for n, figs in equal.items() if figs},
        **verdicts,
        "collapsed": {n: sorted(s for s, r in runs.items() if r.collapsed) for n, runs in results.items() if runs},
        "diagnostics": {n: {k: spread({s: curves[n][s].diagnostics[k] for s in by_seed if k in by_seed[s].diagnostics})
                            .as_json() for k in DIAGNOSTICS
                            if any(k in c.diagnostics for c in by_seed.values())}
                        for n, by_seed in curves.items() if by_seed},
        "seeds_in_both": sorted(set(ref) & set(cand)),
        "per_step_learning": per_step_learning(curves),
    }


def per_step_learning(curves: Mapping[str, Mapping[int, Curves]]) -> dict:
    """Per setting and reward level: the RL steps until the training reward's trailing mean
    reached it, and per seed the reference's steps over this setting's (< 1: it needed more
    steps than the reference to learn as much)."""
    out: dict[str, dict] = {}
    ref = curves.get(REFERENCE, {})
    for name, by_seed in curves.items():
        per = {}
        for level in REWARD_LEVELS:
            steps = {s: steps_to_reward([(p.step, p.reward) for p in c.reward], level, REWARD_WINDOW)
                     for s, c in by_seed.items()}
            got = {s: float(n) for s, n in steps.items() if n is not None}
            ref_steps = {s: steps_to_reward([(p.step, p.reward) for p in c.reward], level, REWARD_WINDOW)
                         for s, c in ref.items()}
            ratio = per_seed_ratios({s: float(n) for s, n in ref_steps.items() if n is not None}, got)
            per[f"{level:g}"] = {"steps": spread(got).as_json(0) if got else None, "reached": len(got),
                                 "ratio_vs_reference": spread(ratio).as_json(3) if ratio and name != REFERENCE
                                 else None}
        if by_seed:
            out[name] = per
    return out


def headline(summary: Mapping) -> dict:
    """What of ``summarise``'s result the last printed line carries: every ratio and verdict and
    the per-setting figures."""
    keys = ("ratio_time_to_acc_async_vs_sync", "time_to_acc_threshold", "reached", "ceiling",
            "accuracy_within_noise", "reward_at_equal_samples_within_noise", "collapsed",
            *HEADLINE_RATIOS, "ratio_async_vs_sync_steps_per_s", "reward_within_noise", "reward_within_noise_rule",
            "settings", "ratios_vs_sync", "step_ratios_vs_sync", "reward_within_noise_per_setting",
            "time_to_accuracy", "equal_footing", "per_step_learning")
    return {k: summary.get(k) for k in keys}


def moving_mean(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start)."""
    out = []
    for j in range(len(ys)):
        part = ys[max(0, j - window + 1):j + 1]
        out.append(sum(part) / len(part))
    return out


def median_curve(curves: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Point-wise median of curves aligned by index (the same RL step / evaluation in every seed),
    cut to the shortest; x is the median samples seen at that index."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [(statistics.median(c[i][0] for c in curves), statistics.median(c[i][1] for c in curves))
            for i in range(n)]


# ---- running ---------------------------------------------------------------------------------------------------

def train(run_dir: Path, overrides: Sequence[str], timeout_s: float) -> tuple[int | str, float, Path]:
    """One ``asyncflow train grpo`` subprocess into a fresh run_dir: (exit code or "timeout", wall s, log)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # one directory holds one run (the HF export refuses to overwrite)
    run_dir.mkdir(parents=True)
    log_path = run_dir.parent / f"{run_dir.name}.train.log"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *overrides, f"trainer.out_dir={run_dir}"]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # own process group: on timeout the rank processes it spawned go too, instead of loading
        # the cores under the next runs
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout_s if timeout_s > 0 else None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the group this Popen made: pgid == its pid
            proc.wait()
            rc = "timeout"
    return rc, time.monotonic() - t0, log_path


def run_limits(steps: int, time_budget_s: float) -> list[str]:
    """What stops every RL run: the same step count (time budget off), or the same RL seconds.

    Equal steps give the faster setting less time; equal seconds are the fair stop for time to
    accuracy (a setting that learns less per step but steps faster gets the same clock)."""
    return [f"trainer.steps={steps}", f"trainer.time_budget_s={time_budget_s:g}"]


def log_tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else f"(no log at {path})"


def warm_up(seed_dir: Path, common: Sequence[str], timeout_s: float) -> tuple[list[str], dict]:
    """The seed's shared warm-up: (overrides that start a run from its weights, its figures)."""
    wdir = seed_dir / "warmup"
    rc, wall, log = train(wdir, [*common, "trainer.steps=0", "trainer.eval_every=0"], timeout_s)
    if rc != 0 or not (wdir / "hf_model").is_dir() or not (wdir / "summary.json").is_file():
        raise RuntimeError(f"warm-up run in {wdir} failed (exit {rc}, {wall:.0f} s); last lines of {log}:\n"
                           f"{log_tail(log)}")
    summ = json.loads((wdir / "summary.json").read_text())
    info = {"warmup_steps": summ.get("warmup_steps"), "accuracy": summ.get("eval_accuracy_after_rl"),
            "wall_s": round(wall, 1)}
    return start_overrides(wdir), info  # the exported policy is every setting's start


def finished_warm_up(seed_dir: Path) -> tuple[list[str], dict]:
    """The figures of a warm-up an earlier invocation ran (--reanalyse)."""
    summ_path = seed_dir / "warmup" / "summary.json"
    if not summ_path.is_file():
        raise RuntimeError(f"--reanalyse: no finished warm-up in {seed_dir / 'warmup'}")
    summ = json.loads(summ_path.read_text())
    return start_overrides(seed_dir / "warmup"), {"warmup_steps": summ.get("warmup_steps"),
                                                  "accuracy": summ.get("eval_accuracy_after_rl"),
                                                  "wall_s": float("nan")}


def start_overrides(warmup_dir: Path) -> list[str]:
    """What starts a run from a warm-up's exported policy (eager attention, as the built-in model)."""
    return [f"model.path={(warmup_dir / 'hf_model').resolve()}", "model.attn_implementation=eager",
            "warmup.enabled=false"]


def plot(curves: Mapping[str, Mapping[int, Curves]], path: Path, title: str) -> None:
    """Reward and accuracy against samples seen: a color per setting, a thin line per seed, the
    point-wise median over seeds in bold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (name, by_seed) in enumerate(curves.items()):
        color = f"C{i}"
        smooth, accs = [], []
        for c in by_seed.values():
            ys = [p.reward for p in c.reward]
            w = max(1, len(ys) // 15)  # the per-step reward is noisy: a trailing mean over ~1/15 of the run
            pts = list(zip([p.samples for p in c.reward], moving_mean(ys, w)))
            smooth.append(pts)
            ev = sorted((e.samples, e.accuracy) for e in c.evals)
            accs.append(ev)
            if pts:
                a1.plot(*zip(*pts), color=color, alpha=0.35, lw=0.8)
            if ev:
                a2.plot(*zip(*ev), "-o", color=color, alpha=0.35, lw=0.8, ms=2)
        for ax, med in ((a1, median_curve(smooth)), (a2, median_curve(accs))):
            if med:
                ax.plot(*zip(*med), color=color, lw=2.2, label=f"{name} (median of {len(by_seed)} seeds)")
    a1.set_title("reward/mean per RL step (trailing mean over ~1/15 of the run)", fontsize=10)
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


def fmt_spread(s: dict | None, spec: str = ".3f") -> str:
    if not s:
        return "-"
    return f"{s['median']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}]"


def print_table(summary: dict, names: Sequence[str]) -> None:
    cols = [("samples_per_s", "samples/s", ".0f"), ("steps_per_s", "steps/s", ".2f"),
            ("rows_per_step", "rows/step", ".1f"), ("reward_last20", "reward last20%", ".3f"),
            ("final_accuracy", "final acc", ".3f"), ("best_accuracy", "best acc", ".3f"),
            ("accuracy_before", "acc before", ".3f"), ("staleness_mean", "stale", ".2f"),
            ("samples", "samples", ".0f")]
    print("\nmedian [min, max] over seeds")
    print(f"{'setting':15} " + " ".join(f"{h:>22}" for _, h, _ in cols))
    for name in names:
        fig = summary["settings"].get(name)
        if fig is None:
            print(f"{name:15} (no finished run)")
            continue
        print(f"{name:15} " + " ".join(f"{fmt_spread(fig.get(k), spec):>22}" for k, _, spec in cols))
    for name, r in summary["ratios_vs_sync"].items():
        print(f"samples/s {name} / {REFERENCE} (per seed, then median): {fmt_spread(r, '.3f')}")
    for name, r in summary["step_ratios_vs_sync"].items():
        print(f"RL steps/s {name} / {REFERENCE} (per seed, then median): {fmt_spread(r, '.3f')}")
    for name, ok in summary["reward_within_noise_per_setting"].items():
        print(f"reward_last20 of {name} within {REFERENCE}'s seed spread: {ok}")
    print("\ntime to held-out accuracy: RL seconds, median [min, max] over the seeds that reached it (reached/seeds)")
    for name in names:
        per = summary["time_to_accuracy"].get(name, {})
        print(f"{name:15} " + "  ".join(
            f"{thr}: {fmt_spread(x['rl_s'], '.0f') if x['rl_s'] else 'never'} ({x['reached']}/{x['of']})"
            for thr, x in per.items()))
    for name in names:
        eq = summary["equal_footing"].get(name, {})
        print(f"{name:15} at equal samples: accuracy {fmt_spread(eq.get('accuracy_at_equal_samples'))}, reward "
              f"{fmt_spread(eq.get('reward_at_equal_samples'))}; at equal RL time: accuracy "
              f"{fmt_spread(eq.get('accuracy_at_equal_time'))}; collapsed seeds: "
              f"{summary['collapsed'].get(name, [])}")
    for name in names:
        per = summary["per_step_learning"].get(name, {})
        print(f"{name:15} RL steps to a training reward (trailing mean of {REWARD_WINDOW}): " + "  ".join(
            f"{lvl}: {fmt_spread(x['steps'], '.0f')} ({x['reached']} seeds)"
            + (f", {REFERENCE}/{name} {fmt_spread(x['ratio_vs_reference'])}" if x["ratio_vs_reference"] else "")
            for lvl, x in per.items()))
    print(f"time to {summary['time_to_acc_threshold']} held-out accuracy, {REFERENCE} / {NOISE_CANDIDATE} per seed: "
          f"{fmt_spread(summary['ratio_time_to_acc_async_vs_sync'])}; async/sync steps/s measured: "
          f"{fmt_spread(summary['ratio_async_vs_sync_steps_per_s'])}")
    c = summary.get("ceiling")
    if c:
        print(f"ceiling (RL steps 1-{c['steps']}, stage costs alone at async's threads): {fmt_spread(c['ratio'])}x "
              f"sync's steps/s; async measured {fmt_spread(c['async_measured'])}x over the same steps")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke scale: 2 seeds, 30 steps of 16 prompts, warm-up of at most 100 steps")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "convergence"))
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2; --quick 0,1)")
    ap.add_argument("--steps", type=int, default=0, help="RL steps per run (default 1500, --quick 30)")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="RL seconds per run, the same for every setting (trainer.time_budget_s); --steps then "
                         "caps the steps (default 100000). 0: stop at --steps, the same prompt budget")
    ap.add_argument("--eval-every", type=int, default=0, help="RL steps between evaluations (default 20, --quick 10)")
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                    help="comma-separated, run in this order for the first seed; known: " + ",".join(SETTINGS))
    ap.add_argument("--run-timeout", type=float, default=0,
                    help="seconds before a run is killed (default 3600, --quick 900; 0 here: the default)")
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                    help="held-out accuracies to time (default %(default)s)")
    ap.add_argument("--ceiling-steps", type=int, default=-1,
                    help="RL steps of each seed's stage-cost run for the ceiling (default 300, --quick 20; 0: none)")
    ap.add_argument("--reanalyse", action="store_true",
                    help="run nothing: summarise the finished runs already in --out (same --seeds/--settings)")
    ap.add_argument("overrides", nargs="*", help="key=value, passed to every run")
    args = ap.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0,1,2"))
        names = parse_settings(args.settings)
        check_overrides(args.overrides, OWNED_KEYS)
        thresholds = parse_thresholds(args.thresholds)
    except ValueError as e:
        ap.error(str(e))
    if args.time_budget < 0:
        ap.error(f"--time-budget {args.time_budget:g}: must be >= 0 seconds (0: stop at --steps)")
    steps = args.steps or (100000 if args.time_budget else 30 if args.quick else 1500)
    every = args.eval_every or (10 if args.quick else 20)
    timeout_s = args.run_timeout or (900.0 if args.quick else 3600.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*run_limits(steps, args.time_budget), f"trainer.eval_every={every}",
            "trainer.progress=false", "trainer.log_samples=true"]
    if args.quick:  # a short warm-up, half-size steps, a smaller held-out set: a smoke-scale comparison
        base += ["warmup.target_accuracy=0.1", "warmup.check_every=50", "warmup.max_steps=100",
                 "trainer.prompts_per_step=16", "rollout.batch_prompts=8", "data.num_eval=128"]
    base += list(args.overrides)
    t_all = time.monotonic()

    orders = rotation(names, len(seeds))
    ceiling_steps = args.ceiling_steps if args.ceiling_steps >= 0 else (20 if args.quick else 300)
    ceilings: dict[int, Ceiling] = {}
    results: dict[str, dict[int, RunResult]] = {n: {} for n in names}
    curves: dict[str, dict[int, Curves]] = {n: {} for n in names}
    warmups: dict[int, dict] = {}
    failed: dict[str, str] = {}
    for seed, order in zip(seeds, orders):
        seed_dir = out / f"seed{seed}"
        common = [f"trainer.seed={seed}", *base]
        print(f"\n== seed {seed}: {' '.join(order)}", flush=True)
        try:
            start, warmups[seed] = (finished_warm_up(seed_dir) if args.reanalyse
                                    else warm_up(seed_dir, common, timeout_s))
        except RuntimeError as e:
            failed[f"seed{seed}/warmup"] = str(e).splitlines()[0]
            print(e, file=sys.stderr, flush=True)
            continue
        w = warmups[seed]
        print(f"warm-up: {w['warmup_steps']} supervised steps, held-out accuracy {w['accuracy']:.3f}, "
              f"{w['wall_s']:.0f} s", flush=True)
        for name in order:
            run_dir = seed_dir / name
            if args.reanalyse:  # the runs of an earlier invocation with the same --out
                rc, wall, log = 0, float("nan"), run_dir.parent / f"{run_dir.name}.train.log"
            else:
                rc, wall, log = train(run_dir, [*common, *start, *SETTINGS[name]], timeout_s)
            try:
                if rc != 0:
                    raise ValueError(f"exit {rc} after {wall:.0f} s")
                c = read_curves(run_dir)
                summ = json.loads((run_dir / "summary.json").read_text())
                r = run_result(c, summ, wall, where=str(run_dir), thresholds=thresholds)
            except (ValueError, OSError) as e:
                failed[f"seed{seed}/{name}"] = f"{e}; see {log}"
                print(f"seed {seed} {name}: FAILED ({e}); last lines of {log}:\n{log_tail(log)}", flush=True)
                continue
            results[name][seed], curves[name][seed] = r, c
            print(f"seed {seed} {name}: {r.rl_steps} RL steps ({r.trained_steps} with rows), {r.samples} rows, "
                  f"{r.samples_per_s:.0f} samples/s, reward last20% {r.reward_last20:.3f}, "
                  f"accuracy {r.accuracy_before:.3f} -> {r.final_accuracy:.3f} (best {r.best_accuracy:.3f}), "
                  f"staleness {r.staleness_mean:.2f}, reached "
                  + ", ".join(f"{x.threshold:g} in {x.rl_s:.0f} s" for x in r.reaches if x.reached)
                  + f"{' COLLAPSED' if r.collapsed else ''}, "
                  f"{wall:.0f} s", flush=True)
        if ceiling_steps and REFERENCE in order and NOISE_CANDIDATE in order:
            costs_dir = seed_dir / COSTS_RUN
            if not (args.reanalyse and (costs_dir / "summary.json").is_file()):
                train(costs_dir, [*common, *start, *COSTS_OVERRIDES, f"trainer.steps={ceiling_steps}"], timeout_s)
            try:
                ceilings[seed] = c = seed_ceiling(seed_dir, ceiling_steps)
                print(f"seed {seed} ceiling over RL steps 1-{ceiling_steps}: {c.ratio:.2f}x sync's steps/s "
                      f"(busiest group alone {max(c.group_s_per_step.values()) * 1e3:.0f} ms/step, sync "
                      f"{c.sync_s_per_step * 1e3:.0f}); async measured {c.measured:.2f}x", flush=True)
            except (ValueError, OSError, KeyError) as e:
                failed[f"seed{seed}/{COSTS_RUN}"] = str(e)
                print(f"seed {seed} {COSTS_RUN}: FAILED ({e})", flush=True)

    summary = summarise(results, curves, thresholds)
    summary["ceiling"] = ceiling_summary(ceilings, ceiling_steps)
    starts = same_start(results)
    if not all(starts.values()):
        print(f"WARNING: the settings of seeds {[s for s, ok in starts.items() if not ok]} did not start from "
              "the same warmed-up policy (before_rl accuracies differ)", flush=True)
    per_run = f"{args.time_budget:g} RL s" if args.time_budget else f"{steps} RL steps"
    title = (f"GRPO on the addition task, seeds {','.join(map(str, seeds))}, {per_run} per run "
             f"(per-seed shared warm-up){' --quick' if args.quick else ''}")
    if any(curves.values()):
        png = out / "convergence.png"
        plot({n: c for n, c in curves.items() if c}, png, title)
        print(f"plot: {png}")
    print_table(summary, names)
    head = {
        **headline(summary),
        "seeds": seeds, "orders": orders, "steps": steps, "time_budget_s": args.time_budget, "eval_every": every,
        "quick": args.quick,
        "thresholds": list(thresholds),
        "overrides": list(args.overrides), "same_start": bool(starts) and all(starts.values()),
        "warmups": {str(s): w for s, w in warmups.items()}, "failed": failed,
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    detail = {**head, "runs": {n: {str(s): asdict(r) for s, r in runs.items()} for n, runs in results.items()},
              "curves": {n: {str(s): asdict(c) for s, c in by_seed.items()} for n, by_seed in curves.items()}}
    (out / "results.json").write_text(json.dumps(detail, indent=1))
    print(json.dumps(head))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
