"""Time to a held-out accuracy, from one run's ``metrics.jsonl``: pure functions, no runs.

A run logs one row per RL step (``step`` = the policy version that step's update produced,
``time_s`` when its report was written) and one row per held-out evaluation (``phase`` rl or
after_rl, ``eval/version`` = the policy version it evaluated). The RL phase begins when the
``before_rl`` evaluation's row is written (nothing of RL runs before it).

The time a run took to reach an accuracy is the RL seconds at which the first policy version
that scored at least that accuracy had been trained: the time of that version's step row, less
the start of RL. An evaluation runs beside training, so the time it took to score the version is
not counted against the run; its cost on the shared cores is (every setting evaluates at the same
step cadence). Samples to an accuracy are the rows that version had trained on.

Equal-samples and equal-time figures compare settings where each has seen as much: the accuracy
of the last evaluation whose version had trained on at most S rows (or had been trained by T RL
seconds), and the mean per-step reward over the last fifth of those samples.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# held-out accuracies timed by default on the main job (its warm-up stops at 0.2)
THRESHOLDS = (0.5, 0.6, 0.7)
EVAL_PHASES = ("rl", "after_rl")


@dataclass(frozen=True)
class VersionPoint:
    """An evaluated policy version: when it was trained, what it had seen, how it scored."""

    version: int
    rl_s: float  # RL seconds when this version's update had finished (0 for the start)
    samples: int  # rows trained into this version
    accuracy: float


@dataclass(frozen=True)
class Reach:
    """The first evaluated version at or above ``threshold`` (None fields: never reached)."""

    threshold: float
    rl_s: float | None
    samples: int | None
    version: int | None

    @property
    def reached(self) -> bool:
        return self.version is not None


def parse_thresholds(text: str) -> tuple[float, ...]:
    """``"0.5,0.6,0.7"`` -> (0.5, 0.6, 0.7): distinct accuracies in (0, 1], sorted."""
    try:
        vals = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--thresholds: expected comma-separated accuracies, got {text!r}") from None
    if not vals or not all(0 < v <= 1 for v in vals):
        raise ValueError(f"--thresholds: need accuracies in (0, 1], got {text!r}")
    return tuple(vals)


def rl_start_s(metrics: Sequence[Mapping]) -> float:
    """``time_s`` of the before_rl evaluation's row: RL starts once it is written."""
    for m in metrics:
        if m.get("phase") == "before_rl":
            return float(m["time_s"])
    raise ValueError("metrics.jsonl has no before_rl evaluation row (the run did not reach RL)")


def step_times(metrics: Sequence[Mapping], start_s: float) -> dict[int, float]:
    """RL seconds at which each step's report was written, keyed by the version it produced."""
    return {int(m["step"]): float(m["time_s"]) - start_s for m in metrics
            if "phase" not in m and "step_time_s" in m}


def version_time(times: Mapping[int, float], version: int) -> float:
    """When ``version`` existed: its own step row, else the first later one (a step with no row
    logged still finished before the next). Version 0 is the start."""
    if version <= 0:
        return 0.0
    if version in times:
        return times[version]
    later = sorted(v for v in times if v >= version)
    if not later:
        raise ValueError(f"no step row at or after version {version} (last: {max(times, default=None)})")
    return times[later[0]]


def version_points(metrics: Sequence[Mapping], cum_samples: Sequence[int]) -> list[VersionPoint]:
    """Every evaluation of the RL phase (and the start), in version order. ``cum_samples[v]`` is
    the rows trained into version v."""
    start = rl_start_s(metrics)
    times = step_times(metrics, start)
    last = len(cum_samples) - 1
    pts = []
    for m in metrics:
        if "eval/accuracy" not in m or m.get("phase") not in ("before_rl", *EVAL_PHASES):
            continue
        v = 0 if m["phase"] == "before_rl" else int(m.get("eval/version", m["step"]))
        pts.append(VersionPoint(v, version_time(times, v), cum_samples[min(max(v, 0), last)],
                                float(m["eval/accuracy"])))
    return sorted(pts, key=lambda p: (p.version, p.rl_s))


def first_reach(points: Sequence[VersionPoint], thresholds: Sequence[float]) -> list[Reach]:
    """Per threshold, the first version (in training order) whose accuracy met it. The start
    (version 0) counts: a run that starts above a threshold reached it at 0 s."""
    out = []
    for thr in thresholds:
        hit = next((p for p in points if p.accuracy >= thr), None)
        out.append(Reach(thr, hit.rl_s if hit else None, hit.samples if hit else None,
                         hit.version if hit else None))
    return out


def accuracy_at(points: Sequence[VersionPoint], *, samples: float | None = None, rl_s: float | None = None) -> float:
    """The accuracy of the last evaluated version trained on at most ``samples`` rows (or trained
    by ``rl_s`` seconds); NaN if none was."""
    if (samples is None) == (rl_s is None):
        raise ValueError("accuracy_at: give exactly one of samples= or rl_s=")
    ok = [p for p in points if (p.samples <= samples if samples is not None else p.rl_s <= rl_s)]
    return max(ok, key=lambda p: p.version).accuracy if ok else float("nan")


def reward_at(samples_and_reward: Sequence[tuple[int, float]], samples: float, fraction: float = 0.2) -> float:
    """Mean per-step reward over the steps whose cumulative samples fall in
    ((1 - fraction) * samples, samples]; NaN if none do. Input sorted by samples."""
    xs = [s for s, _ in samples_and_reward]
    lo = bisect.bisect_right(xs, (1 - fraction) * samples)
    hi = bisect.bisect_right(xs, samples)
    part = [r for _, r in samples_and_reward[lo:hi]]
    return sum(part) / len(part) if part else float("nan")


def collapsed(points: Sequence[VersionPoint]) -> bool:
    """RL ended below where it started: the last evaluation scores under the first (version 0)."""
    start = [p for p in points if p.version == 0]
    rest = [p for p in points if p.version > 0]
    if not start or not rest:
        return False
    return rest[-1].accuracy < start[0].accuracy


def reached(reaches: Sequence[Reach], index: int) -> bool:
    """Whether threshold ``index`` was reached (a run timed on fewer thresholds did not)."""
    return index < len(reaches) and reaches[index].reached


def highest_reached_by_all(reaches: Mapping[str, Mapping[int, Sequence[Reach]]], thresholds: Sequence[float],
                           settings: Sequence[str]) -> float | None:
    """The highest threshold every seed of every named setting reached (None: not even the lowest)."""
    best = None
    for i, thr in enumerate(thresholds):
        runs = [reaches.get(s, {}) for s in settings]
        if all(runs) and all(reached(r, i) for by_seed in runs for r in by_seed.values()):
            best = thr
    return best


def reached_counts(reaches: Mapping[int, Sequence[Reach]], thresholds: Sequence[float]) -> dict[str, int]:
    """How many seeds reached each threshold."""
    return {f"{t:g}": sum(1 for r in reaches.values() if reached(r, i)) for i, t in enumerate(thresholds)}


def time_ratios(slow: Mapping[int, Sequence[Reach]], fast: Mapping[int, Sequence[Reach]],
                index: int) -> dict[int, float]:
    """Per seed that both reached threshold ``index``: slow's RL seconds over fast's (> 1: fast
    got there sooner). A setting that reached it at 0 s (started above it) gives no ratio."""
    out = {}
    for seed, rs in fast.items():
        if seed in slow and reached(rs, index) and reached(slow[seed], index):
            a, b = slow[seed][index].rl_s, rs[index].rl_s
            if a is not None and b is not None and b > 0 and not math.isnan(a):
                out[seed] = a / b
    return out


def steps_to_reward(steps_and_rewards: Sequence[tuple[int, float]], level: float, window: int = 100) -> int | None:
    """The first RL step at which the trailing mean of the per-step training reward over ``window``
    steps reached ``level`` (None: never). The training reward averages a whole step's rows, so
    its trailing mean says how far the policy has learned per step with far less noise than a
    held-out evaluation every few steps."""
    if window < 1:
        raise ValueError(f"steps_to_reward: window must be >= 1, got {window}")
    total, part = 0.0, []
    for step, reward in steps_and_rewards:
        part.append(reward)
        total += reward
        if len(part) > window:
            total -= part.pop(0)
        if len(part) == window and total / window >= level:
            return step
    return None
