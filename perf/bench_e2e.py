"""End-to-end RL throughput: AsyncFlow's workflow modes and TRL on the same GRPO job.

One GRPO job (reference and reward stages: ``algorithm.kl_coef=0.01``; the addition task;
prompts x group size rows per step; no dynamic sampling, so every run trains the same rows;
the same seed, number of steps and learning rate, ``--lr``) runs as its own ``python -m asyncflow.cli train grpo``
subprocess on the 2 local CPU ranks, in four modes:

  sync_colocated  workflow.mode=sync, placement.mode=colocated (the verl-style baseline:
                  every role on both ranks, one stage after the other)
  sync            workflow.mode=sync, disaggregated (actor rank 0, rollout rank 1)
  stream          workflow.mode=stream, disaggregated (micro-batches flow as soon as ready)
  async           workflow.mode=async, max_staleness 1, disaggregated

and TRL's GRPOTrainer as a peer (entry ``trl``: perf/_trl_peer.py, in its own venv
perf/.venv-trl, made here on first use). With --vllm (run with the vLLM venv's python) two
more entries:

  async_vllm      the async mode with its rollout on vLLM (rollout.engine=vllm,
                  rollout.engine_kwargs VLLM_ENGINE_KWARGS): the main job on vLLM
  trl_vllm        TRL generating with vLLM colocated in its process (use_vllm, vllm_mode
                  "colocate"), from perf/.venv-trl-vllm (vllm-cpu's pins, TRL within them,
                  made here on first use)

Every run's process tree is sampled for its peak RSS (``peak_tree_rss_mb``: the launcher,
its ranks and, on vLLM, the engine's worker processes). The disaggregated modes put the
actor on rank 0 and the rollout and the reference model on rank 1 (``placement.ref_with=
rollout``, --ref-with); where the reward scores is each mode's own choice (below).

The policy every run starts from: the warmed-up model, as the main job's. ``asyncflow
train`` runs a supervised warm-up until held-out accuracy reaches ``warmup.target_accuracy``
before RL; here it runs once (a run with ``trainer.steps=0``, as perf/convergence.py shares
one) and every AsyncFlow run and TRL start from its exported weights (``model.path=...
warmup.enabled=false``), so reward/mean moves and the reward curves say whether each mode
learns as well per sample. The warm-up is cached in --out (reused while its settings are
the same; --fresh-warmup redoes it).

Fairness, what is done about each source of bias:
- Every entry at its own best. A mode's configuration is its torch threads per rank
  (--threads, default 0,1,2; 0 is auto, the product's rule ``rank_threads``: every core in
  sync disaggregated, the cores shared out among the ranks otherwise; counts that resolve to
  the same number run once, as auto) and where its reward scores (--reward-with, default
  every value of placement.reward_with: actor, rollout, inline; colocated runs actor and
  rollout once, the same ranks); TRL's is its process's torch threads (--trl-threads,
  default 2,1). Phase 1, the sweep: every configuration of each entry that has more than
  one runs --sweep-passes times (default twice, in opposite orders) for --sweep-steps steps
  (default --steps), the entries taking turns (out/sweep/); each entry's configuration with the highest median
  (modes: samples/s; TRL: useful tokens/s) is chosen. Phase 2, the repetitions: each entry
  runs in its chosen configuration only. The sweep's runs choose, the repetitions' runs
  judge: no run does both. --no-sweep runs every entry at the first value of each list.
  results.json names each entry's configuration (``settings``) and every sweep
  measurement that chose it (``sweep``).
- The sync baseline: ``ratio_async_vs_sync`` is async over the BETTER sync entry (the one
  of sync_colocated and sync with the higher median samples/s in the repetitions, each at
  its best configuration: the best sync over placement x threads x reward placement;
  ``sync_baseline`` names it); both per-mode figures and both ratios stay in the JSON.
- Order and noise: the repetitions follow a Williams design over the entries
  (balanced_orders): every entry takes every position equally often, and over a whole
  design (n entries: n repetitions for even n, 2n for odd n) every entry runs directly
  after every other equally often, so neither a slot nor a neighbour's carryover (a hot
  core, a full page cache) favours one entry. --reps (default 0: as few as balance allows)
  is raised to the smallest multiple of the entries at or above max(--reps, 3), with a
  note; ``orders_balanced`` and ``carryover_balanced`` say what the run achieved. Every
  ratio is computed per repetition and reported as its median and its min/max over the
  repetitions; samples/s per entry as the median over the repetitions.
- The ideal bound of an overlapped mode (stream, async) comes from stage costs measured
  WITHOUT overlap and apart from the judged runs: a sync disaggregated run on the same
  placement with the same threads per rank (the sweep's, when it ran that configuration;
  otherwise one run made for it, out/standalone/; ``standalone_for_bounds`` says which),
  where one step's stages run one after another. Each rank group's cost per step is the
  union of its stages' spans there (timeline.jsonl; reward and reference may run at the
  same time on different ranks, and the union counts a shared core once); stages on the
  same ranks add up, groups on different ranks overlap, so the busiest group sets the pace:
  bound = rows_per_step / max_g cost_g. Efficiency = samples/s / bound. A run's own spans
  are not used to judge it: overlap inflates them (two processes share a core, the
  rollout's weight receive runs beside generation), which would flatter the efficiency.
- TRL on equal work: the same warmed-up weights, the same prompts in the same order (token
  ids checked equal), the same reward rule, sampling (temperature 1, no top-p/k), group
  size, batch, learning rate and warm-up, clip and KL coefficient. Lengths (--lengths):
    natural  both sides stop a row at EOS or at --max-new-tokens; the same policy samples
             the same prompts, so the rows' lengths match in distribution (the JSON shows
             generated tokens per row on both sides);
    fixed    every row generates exactly --max-new-tokens tokens on both sides (TRL:
             min_new_tokens, EOS suppressed; AsyncFlow: ``rollout.ignore_eos=true``, checked
             on every row). Fixed lengths measure speed more than learning: TRL's suppressed
             EOS makes the answer run on into other characters, while AsyncFlow's reward
             reads a response up to its first EOS, so the reward curves of the two sides
             are not comparable here;
    longtail the long-tailed workload of reasoning RL (``workload: longtail_reasoning`` in
             the JSON): every row has its own target length, AsyncFlow's per-row budgets
             (``rollout.length_profile=longtail``: a seeded lognormal, sigma 1, median 0.15
             x the cap, capped at the cap; most rows short, about 3% at the cap, 6.7x the
             median), the cap defaulting to the tiny model's context less room for the
             prompt (112 of 128 positions). AsyncFlow: EOS ignored (``rollout.ignore_eos``),
             each row stops at its own budget (checked row by row: uid, sample and length).
             TRL: the same target for the same (prompt, sample), from the same function;
             its ``generate`` takes one length per batch, so each batch runs to its longest
             target with EOS suppressed (the cost of a static batch: every row is computed
             until the longest ends) and each row is cut to its target before reward and
             loss (perf/_trl_peer.py). Both sides train the same useful tokens
             (``useful_tokens_per_row``); ``gen_tokens_per_row`` counts what was generated,
             TRL's cut-off padding included. TRL's vLLM entry takes one budget for all
             rows and is refused here. The reward-curve caveat of fixed applies.
  TRL runs as one process at its best thread count from the sweep (with 2 threads it uses
  both cores, but on a shared machine a thread that loses its core stalls every parallel
  op of the tiny model). Tokens are counted the same way on both sides (``generated_tokens``:
  every token a row generated, EOS included, prompts not; AsyncFlow's summary tokens_per_s
  also counts prompt tokens, so it is not used); ``useful_tokens`` are the tokens a row keeps
  and trains (the same as generated except TRL's cut-off padding under longtail); both
  clocks time the RL phase only (AsyncFlow: ``rl_s``; TRL: on_train_begin to on_train_end),
  and TRL's gradient checkpointing is off. ``ratio_async_vs_trl_tokens`` = async useful
  tokens/s over the best TRL entry's (with --vllm, trl_vllm competes for it), per
  repetition; ``ratio_async_vllm_vs_async`` and ``ratio_async_vllm_vs_trl_tokens`` the same
  for the main job on vLLM.

Per entry the table shows its configuration and the medians over the repetitions:
samples/s (and its range), generated tokens/s and per row, useful tokens/s and per row, the
bound and efficiency (overlapped modes), staleness, each stage's busy seconds per step (the
mean of ``timing_s/<stage>`` in metrics.jsonl; ``weight_sync``: the actor rank's publish
spans from timeline.jsonl); results.json also keeps each run's idle ratio per role and rank
busy time. samples/s is over the whole RL phase (summary.json's ``rl_s``), first step
included.

It writes, under --out (default perf/out/bench_e2e/): warmup/ (the shared warm-up),
sweep/pass<p>/<entry>-<config>/ (the sweep), standalone/ (bounds not found in the sweep),
rep<k>/<entry>/ (each judged run's output directory), reward_curves.png (reward/mean
against samples seen and against RL wall time, every entry, every repetition) and
results.json. The last line printed is one JSON object.

    python perf/bench_e2e.py [--quick] [--lengths natural|fixed|longtail] [--no-sweep] [--reps N]
                             [--threads 0,1,2] [--reward-with actor,rollout,inline] [--out DIR]
                             [--no-trl] [--vllm]
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
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TORCH = "2.13.0"
TRANSFORMERS = "5.24.0"
TRL = "1.16.0"
TRL_VENV = ROOT / "perf" / ".venv-trl"
RECIPE = ROOT / "recipes" / "grpo" / "config.yaml"

TRL_VLLM_VENV = ROOT / "perf" / ".venv-trl-vllm"  # TRL beside vllm-cpu (its pins: requirements-vllm-cpu.txt)
VLLM_REQUIREMENTS = ROOT / "requirements-vllm-cpu.txt"
# The main job's rollout on vLLM (rollout.engine_kwargs): eager, a 256 MiB KV cache.
VLLM_ENGINE_KWARGS = "{enforce_eager: true, kv_cache_memory_bytes: 268435456}"
VLLM_EXTRA_TIMEOUT_S = 300.0  # a vLLM run builds an engine (30-90 s on 2 shared cores) before its first step

MODES = {
    "sync_colocated": ["workflow.mode=sync", "placement.mode=colocated"],
    "sync": ["workflow.mode=sync", "placement.mode=disaggregated"],
    "stream": ["workflow.mode=stream", "placement.mode=disaggregated"],
    "async": ["workflow.mode=async", "workflow.max_staleness=1", "placement.mode=disaggregated"],
    # the main job's workload and mode, its rollout on vLLM (--vllm)
    "async_vllm": ["workflow.mode=async", "workflow.max_staleness=1", "placement.mode=disaggregated",
                   "rollout.engine=vllm", f"rollout.engine_kwargs={VLLM_ENGINE_KWARGS}"],
}
VLLM_MODES = ("async_vllm",)
BUILTIN_MODES = tuple(m for m in MODES if m not in VLLM_MODES)
SYNC_MODES = ("sync_colocated", "sync")
OVERLAPPED = ("stream", "async")
STANDALONE = "sync"  # the mode whose stage costs (one stage after another, same placement) bound the overlapped modes
TRL_PREFIX = "trl"  # TRL entries: trl (transformers generate), trl_vllm (vLLM colocated, with --vllm)
TRL_ENTRY, TRL_VLLM = "trl", "trl_vllm"
REF_WITH = "rollout"  # where the reference model sits in every disaggregated mode (see the docstring)
REWARD_PLACEMENTS = ("actor", "rollout", "inline")  # placement.reward_with's values (asyncflow/config.py)
STAGES = ("rollout", "reward", "ref_log_prob", "update", "weight_sync")
LENGTHS = ("natural", "fixed", "longtail")
IGNORE_EOS_KEY = "rollout.ignore_eos"  # what --lengths fixed and longtail pass to AsyncFlow
LENGTH_PROFILE_KEY = "rollout.length_profile"  # per-row budgets (asyncflow.workflow.source.longtail_budgets)
WARMUP_THREADS = 1  # the shared warm-up (one run, not measured)
# --max-new-tokens default per workload. longtail: the tiny model's 128 positions less room for
# the addition prompts, so the tail reaches as far as the context allows.
DEFAULT_CAP = {"natural": 16, "fixed": 16, "longtail": 112}
# The RL learning rate of every run (AsyncFlow's optim.lr, TRL's learning_rate). Not the main
# job's 3e-4: that rate fits its 32 x 8 steps with dynamic sampling, while this workload's 16 x 4
# steps, every group kept, unlearn at it; a throughput benchmark still trains a policy that improves.
DEFAULT_LR = 5e-5
# The long-tailed workload's name in results.json (the issue that sets its token target names it too).
LONGTAIL_WORKLOAD = "longtail_reasoning"
TARGETS = {"ratio_async_vs_sync": 1.6, "ratio_async_vs_trl_tokens": 1.5}
HEADLINE_RATIOS = ("ratio_async_vs_sync", "ratio_async_vs_sync_colocated", "ratio_async_vs_sync_disaggregated",
                   "ratio_stream_vs_sync", "ratio_async_vs_trl", "ratio_async_vs_trl_tokens")


# ---- pure logic -------------------------------------------------------------------------------

def rotation(names: Sequence[str], reps: int) -> list[list[str]]:
    """A cyclic order: rep r starts at names[r % n] and wraps around. Each entry takes each
    position equally often only over a multiple of n repetitions, and the entry after each one
    is always the same, so a carryover (the cores' state a run leaves to the next) is never
    balanced. perf/convergence.py orders its runs with it; this bench uses balanced_orders."""
    if reps < 1 or not names:
        raise ValueError(f"rotation: need at least one repetition and one name, got reps={reps}, names={list(names)}")
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(reps)]


def williams_design(n: int) -> list[list[int]]:
    """A Williams design over n entries: rows that are each a Latin square's row (every entry in
    every position once per n rows) and in which every entry follows every other equally often.
    The first row is 0, 1, n-1, 2, n-2, ...; row r adds r to it (mod n). For even n those n
    rows are the design; for odd n > 1 the n mirrored rows follow (2n rows)."""
    if n < 1:
        raise ValueError(f"williams_design: need at least one entry, got {n}")
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def balanced_reps(requested: int, n_entries: int, least: int = 3) -> int:
    """The repetitions to run: the smallest multiple of the entries at or above both the request
    and ``least`` (a median and a spread need 3), so that every entry takes every position equally often."""
    if n_entries < 1:
        raise ValueError("balanced_reps: no entries to order")
    want = max(requested, least)
    return -(-want // n_entries) * n_entries


def balanced_orders(names: Sequence[str], reps: int) -> list[list[str]]:
    """The order of each repetition: the rows of williams_design(len(names)) in turn. Over a
    multiple of len(names) repetitions each entry takes each position equally often; over a
    multiple of the design's rows (n even: n; n odd: 2n) each entry also follows each other
    entry equally often. Any other count is refused (balanced_reps gives one that is not)."""
    n = len(names)
    if n < 1 or len(set(names)) != n:
        raise ValueError(f"balanced_orders: need distinct names, got {list(names)}")
    if reps < 1 or reps % n:
        raise ValueError(f"balanced_orders: {reps} repetitions of {n} entries cannot put each entry in each "
                         f"position equally often; use a multiple of {n} (balanced_reps)")
    design = williams_design(n)
    return [[names[i] for i in design[r % len(design)]] for r in range(reps)]


def positions_balanced(orders: list[list[str]]) -> bool:
    """Each entry in each position equally often over these repetitions."""
    names = sorted(orders[0]) if orders else []
    return all(sorted(o) == names for o in orders) and all(
        len({sum(o[pos] == m for o in orders) for m in names}) == 1 for pos in range(len(names)))


def carryover_balanced(orders: list[list[str]]) -> bool:
    """Each entry directly after each other entry equally often over these repetitions (first-order
    carryover: what one run leaves behind, a warm cache or a hot core, falls on every entry alike)."""
    names = sorted(orders[0]) if orders else []
    counts = {(a, b): 0 for a in names for b in names if a != b}
    for o in orders:
        for a, b in zip(o, o[1:]):
            counts[(a, b)] += 1
    return len(set(counts.values())) <= 1


@dataclass(frozen=True)
class Spread:
    """The median of values measured once per repetition, and their range."""

    median: float
    lo: float
    hi: float
    values: tuple[float, ...]

    def as_json(self, digits: int = 3) -> dict:
        return {"median": round(self.median, digits), "min": round(self.lo, digits), "max": round(self.hi, digits),
                "per_rep": [round(v, digits) for v in self.values]}


def spread(values: Iterable[float]) -> Spread:
    vals = tuple(float(v) for v in values)
    if not vals:
        raise ValueError("spread: no values (every repetition of this figure failed)")
    return Spread(statistics.median(vals), min(vals), max(vals), vals)


def per_rep_ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
    """num[r] / den[r] for each repetition r where both were measured (a failed run is None)."""
    if len(num) != len(den):
        raise ValueError(f"per_rep_ratios: {len(num)} numerators but {len(den)} denominators")
    return [n / d for n, d in zip(num, den) if n is not None and d is not None and d > 0]


def better_of(medians: dict[str, float], candidates: Iterable[str]) -> str:
    """The candidate with the highest median: the baseline to beat (the better sync placement,
    TRL at its better thread count)."""
    present = [m for m in candidates if medians.get(m) is not None]
    if not present:
        raise ValueError(f"better_of: none of {list(candidates)} was measured (have {sorted(medians)})")
    return max(present, key=lambda m: medians[m])


@dataclass(frozen=True)
class Setting:
    """One configuration of an entry. AsyncFlow: torch threads per rank (0: auto, the product's
    rule, ``rank_threads``) and where the reward scores (placement.reward_with); TRL: the torch
    threads of its one process (reward_with None)."""

    threads: int
    reward_with: str | None = None

    @property
    def label(self) -> str:
        t = "auto" if self.threads == 0 else f"{self.threads}t"
        return t if self.reward_with is None else f"{t}_reward_{self.reward_with}"

    def as_json(self) -> dict:
        return {"label": self.label, "threads": self.threads, "reward_with": self.reward_with}


def resolved_threads(mode: str, threads: int, cpus: int) -> int:
    """The torch threads a rank of ``mode`` runs with at trainer.threads=threads on ``cpus``
    cores: the product's rank_threads, its 0 (torch's default) read as every core."""
    from asyncflow.config import load_config, rank_threads
    return rank_threads(load_config(RECIPE, [*MODES[mode], f"trainer.threads={threads}"]), cpus) or cpus


def mode_settings(mode: str, threads: Sequence[int], rewards: Sequence[str], cpus: int) -> list[Setting]:
    """The configurations of ``mode`` to sweep: threads x reward placement, one per distinct
    resolved thread count (auto kept over the explicit count it equals) and placement. Colocated,
    every role is on every rank, so reward_with=actor and =rollout are one placement (kept once)."""
    unknown = [r for r in rewards if r not in REWARD_PLACEMENTS]
    if unknown or not rewards:
        raise ValueError(f"--reward-with: {list(rewards)}; known: {', '.join(REWARD_PLACEMENTS)}")
    if not threads or any(t < 0 for t in threads):
        raise ValueError(f"--threads: counts >= 0 needed (0: auto), got {list(threads)}")
    colocated = "placement.mode=colocated" in MODES[mode]
    seen: dict[tuple[int, str], Setting] = {}
    for t in sorted(dict.fromkeys(threads), key=lambda t: (t != 0, t)):  # auto first: it wins a tie
        for r in dict.fromkeys(rewards):
            key = (resolved_threads(mode, t, cpus), "actor" if colocated and r == "rollout" else r)
            seen.setdefault(key, Setting(t, r))
    return list(seen.values())


def trl_settings(threads: Sequence[int], vllm: bool = False) -> list[Setting]:
    """TRL's configurations: one per torch thread count of its process."""
    if not threads or any(t < 1 for t in threads):
        raise ValueError(f"--trl{'-vllm' if vllm else ''}-threads: positive thread counts needed, got {list(threads)}")
    return [Setting(int(t)) for t in dict.fromkeys(threads)]


def sweep_order(settings: dict[str, list[Setting]], passes: int) -> list[tuple[str, Setting]]:
    """The sweep's runs: entries taking turns (one configuration of each in turn), so that a
    slow spell of the shared machine does not fall on one entry's configurations; each pass
    walks the list in the opposite direction of the one before."""
    longest = max((len(v) for v in settings.values()), default=0)
    one = [(e, ss[i]) for i in range(longest) for e, ss in settings.items() if i < len(ss)]
    return [run for p in range(passes) for run in (one if p % 2 == 0 else one[::-1])]


def choose(results: dict[str, list[dict]], key: str) -> str:
    """The configuration (label) with the highest median ``key`` over its sweep runs; failed runs
    (no ``key``) left out."""
    medians = {label: statistics.median(r[key] for r in runs if r.get(key) is not None)
               for label, runs in results.items() if any(r.get(key) is not None for r in runs)}
    if not medians:
        raise ValueError(f"choose: every configuration failed ({', '.join(results)})")
    return max(medians, key=lambda label: medians[label])


def entry_timeout(name: str, base_s: float) -> float:
    """A run's time limit: vLLM entries build an engine first."""
    return base_s + (VLLM_EXTRA_TIMEOUT_S if name in VLLM_MODES or name == TRL_VLLM else 0.0)


def select_modes(requested: str, vllm: bool) -> list[str]:
    """--modes (empty: every built-in mode) and, with --vllm, the vLLM ones; unknown names refused."""
    modes = [m for m in requested.split(",") if m] or list(BUILTIN_MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    return list(dict.fromkeys([*modes, *(VLLM_MODES if vllm else ())]))


@dataclass(frozen=True)
class RankGroup:
    """Ranks that share work, and the stages they run (costs of stages on one group add up)."""

    ranks: frozenset[str]  # timeline lane prefixes: "rank0", ...
    stages: frozenset[str]


def rank_groups(placement: dict, stages: Iterable[str], lanes: Iterable[str]) -> dict[str, RankGroup]:
    """Disaggregated: the actor ranks (update, weight_sync publish, and reward / reference when
    placed with the actor) and the rollout ranks (rollout, and reward / reference placed with
    it). Colocated: one group holding every stage on every rank."""
    stages = frozenset(stages)
    if placement["mode"] != "disaggregated":
        return {"all_ranks": RankGroup(frozenset(lanes), stages)}
    rollout_side = {"rollout"} | {s for s, key in (("reward", "reward_with"), ("ref_log_prob", "ref_with"))
                                  if placement.get(key, "actor") == "rollout"}
    return {"actor_ranks": RankGroup(frozenset(f"rank{r}" for r in placement["actor_ranks"]), stages - rollout_side),
            "rollout_ranks": RankGroup(frozenset(f"rank{r}" for r in placement["rollout_ranks"]),
                                       stages & rollout_side)}


def union_s(spans: Iterable[dict]) -> float:
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


def group_costs(spans: list[dict], groups: dict[str, RankGroup], steps: int) -> dict[str, float]:
    """Each group's busy seconds per step: the union of its stages' spans on its ranks. The
    weight sync counts on the actor side only (the rollout side's receive is a background copy)."""
    def mine(s: dict, g: RankGroup) -> bool:
        return (s["stage"] in g.stages and s["lane"].split()[0] in g.ranks
                and (s["stage"] != "weight_sync" or s["lane"].endswith(" actor")))
    return {name: union_s([s for s in spans if mine(s, g)]) / max(steps, 1) for name, g in groups.items()}


def overlapped_bound(rows_per_step: int, standalone: dict[str, float], judged_groups: Iterable[str]) -> float:
    """Ideal samples/s of an overlapped run from stage costs measured without overlap: the busiest
    rank group sets the pace. ``standalone`` must come from a run with the same rank groups."""
    judged = sorted(judged_groups)
    if sorted(standalone) != judged:
        raise ValueError(f"overlapped_bound: stand-alone costs are for groups {sorted(standalone)}, the judged run "
                         f"has {judged}; they must come from a run with the same placement")
    worst = max(standalone.values())
    if worst <= 0:
        raise ValueError(f"overlapped_bound: no stage cost measured ({standalone})")
    return rows_per_step / worst


def generated_tokens(responses: Iterable[Sized]) -> int:
    """Tokens the rollout generated: each row's response ids as kept, its EOS included when it
    produced one. Both AsyncFlow (samples.jsonl response_ids) and TRL (completion_ids, cut after
    the first EOS) count with this; prompts are not counted."""
    return sum(len(r) for r in responses)


def length_stats(lengths: Sequence[int], cap: int) -> dict:
    ls = sorted(int(x) for x in lengths)
    if not ls:
        return {"mean": 0.0, "p50": 0, "p90": 0, "max": 0, "at_cap": 0.0}
    return {"mean": statistics.fmean(ls), "p50": ls[len(ls) // 2], "p90": ls[int(len(ls) * 0.9)], "max": ls[-1],
            "at_cap": sum(x >= cap for x in ls) / len(ls)}


def check_fixed_lengths(lengths: Sequence[int], budget: int, where: str) -> None:
    """--lengths fixed promises budget tokens on every row: a shorter row means EOS stopped it."""
    off = [n for n in lengths if n != budget]
    if off:
        raise ValueError(f"{where}: {len(off)} of {len(lengths)} rows do not have the fixed {budget} tokens "
                         f"(lengths seen: {sorted(set(off))[:8]}); EOS was not ignored")


def row_targets(seed: int, cap: int, n_prompts: int, group: int) -> list[list[int]]:
    """--lengths longtail: the target length of each row, [prompt uid][sample j], for the first
    n_prompts prompts of the stream: AsyncFlow's own per-row budgets (rollout.length_profile=
    longtail: seeded lognormal, median 0.15 x cap, capped at cap), the same numbers TRL is given."""
    from asyncflow.workflow.source import longtail_budgets
    budget = longtail_budgets(seed, cap)
    return [[budget(uid, j) for j in range(group)] for uid in range(n_prompts)]


def check_targets(rows: Sequence[dict], targets: list[list[int]], seed: int, where: str) -> None:
    """--lengths longtail promises that the trained rows are prompts 0..N-1 x group (the ones TRL
    trains) and that each has exactly its target's tokens. A row is known by its prompt uid and
    its sampling seed (row_seed(seed, uid, j) names its sample j)."""
    from asyncflow.workflow.source import row_seed
    want = {(uid, row_seed(seed, uid, j)): t for uid, ts in enumerate(targets) for j, t in enumerate(ts)}
    got = {(int(r["uid"]), int(r["seed"])): len(r["response_ids"]) for r in rows}
    if len(got) != len(rows) or set(got) != set(want):
        extra, missing = sorted(set(got) - set(want))[:4], sorted(set(want) - set(got))[:4]
        raise ValueError(f"{where}: the trained rows are not the {len(want)} rows of prompts 0..{len(targets) - 1} "
                         f"(uid, seed) once each ({len(rows)} rows; not expected: {extra}; missing: {missing}), "
                         "so the two sides would not train the same targets")
    off = [(k, got[k], want[k]) for k in want if got[k] != want[k]]
    if off:
        raise ValueError(f"{where}: {len(off)} of {len(want)} rows do not have their target length "
                         f"((uid, seed), tokens, target): {off[:4]}; EOS was not ignored or the budget not honoured")


# ---- memory: resident set sizes of a process tree, from /proc (Linux) ---------------------------

def status_kb(text: str, key: str = "VmRSS") -> int | None:
    """The ``<key>: <n> kB`` field of a /proc/<pid>/status text (None when absent: a kernel thread,
    a zombie)."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def stat_ppid(text: str) -> int:
    """The parent pid in a /proc/<pid>/stat text. The command name before it is in parentheses and
    may itself hold spaces and ')', so the fields are read after the last ')'."""
    return int(text.rsplit(")", 1)[1].split()[1])


def descendants(parent_of: dict[int, int], root: int) -> list[int]:
    """Every process below root (children, their children, ...), from a pid -> parent pid table."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process is gone
        return None


def process_table() -> dict[int, int]:
    """pid -> parent pid of every process now (empty without /proc)."""
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            text = _read(f"/proc/{name}/stat")
            if text:
                out[int(name)] = stat_ppid(text)
    return out


def rss_kb(pids: Iterable[int], key: str = "VmRSS") -> dict[int, int]:
    """Resident kB of each process (VmHWM: its peak so far); gone processes are left out."""
    out = {}
    for pid in pids:
        text = _read(f"/proc/{pid}/status")
        kb = status_kb(text, key) if text else None
        if kb is not None:
            out[pid] = kb
    return out


class TreeRSS:
    """Samples the summed RSS of a process and everything below it on a thread, every
    ``interval_s``; ``peak_mb`` is the highest sum seen (processes that come and go between
    samples are missed, so it is a lower bound)."""

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        import threading
        self.root, self.interval_s = root, interval_s
        self.peak_kb, self.peak_processes, self.samples = 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        sizes = rss_kb([self.root, *descendants(process_table(), self.root)])
        self.samples += 1
        if sum(sizes.values()) > self.peak_kb:
            self.peak_kb, self.peak_processes = sum(sizes.values()), len(sizes)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_tree_rss_mb": round(self.peak_kb / 1024, 1), "processes_at_peak": self.peak_processes,
                "rss_samples": self.samples}


def summarise(reps: list[dict[str, dict]], rows_per_step: int) -> dict:
    """The JSON summary from each repetition's analysed runs ({entry: result}, a failed one has
    "error"): medians over repetitions, per-repetition ratios with their median and range."""
    def col(name: str, key: str) -> list[float | None]:
        return [r.get(name, {}).get(key) for r in reps]

    names = list(dict.fromkeys(k for r in reps for k in r))
    sps = {n: spread([v for v in col(n, "samples_per_s") if v is not None]) for n in names
           if any(v is not None for v in col(n, "samples_per_s"))}
    def spreads(key: str) -> dict[str, Spread]:
        return {n: spread([v for v in col(n, key) if v is not None]) for n in names
                if any(v is not None for v in col(n, key))}

    tps, uts = spreads("gen_tokens_per_s"), spreads("useful_tokens_per_s")
    ratios: dict[str, Spread] = {}

    def add(key: str, num: str, den: str, field: str = "samples_per_s") -> None:
        vals = per_rep_ratios(col(num, field), col(den, field))
        if vals:
            ratios[key] = spread(vals)

    baseline = trl_base = None
    if any(m in sps for m in SYNC_MODES):
        baseline = better_of({m: s.median for m, s in sps.items()}, SYNC_MODES)
        add("ratio_async_vs_sync", "async", baseline)
    add("ratio_async_vs_sync_colocated", "async", "sync_colocated")
    add("ratio_async_vs_sync_disaggregated", "async", "sync")
    if baseline:
        add("ratio_stream_vs_sync", "stream", baseline)
    # TRL is judged by the tokens both sides train on (useful tokens: generated and kept; TRL's
    # rows cut to their targets under --lengths longtail are generated, not useful)
    trls = [n for n in names if n.startswith(TRL_PREFIX) and n in uts]
    if trls:
        trl_base = better_of({n: uts[n].median for n in trls}, trls)
        add("ratio_async_vs_trl_tokens", "async", trl_base, "useful_tokens_per_s")
        add("ratio_async_vs_trl", "async", trl_base)
        for n in trls:
            if n != trl_base:
                add(f"ratio_async_vs_entry_{n}_tokens", "async", n, "useful_tokens_per_s")  # not the headline's name
    add("ratio_async_vllm_vs_async", "async_vllm", "async")
    if trls:
        add("ratio_async_vllm_vs_trl_tokens", "async_vllm", trl_base, "useful_tokens_per_s")
    rss = {n: statistics.median(v for v in col(n, "peak_tree_rss_mb") if v is not None) for n in names
           if any(v is not None for v in col(n, "peak_tree_rss_mb"))}
    bounds = {m: spread([v for v in col(m, "bound_samples_per_s") if v is not None]) for m in OVERLAPPED
              if any(v is not None for v in col(m, "bound_samples_per_s"))}
    eff = {m: spread([v for v in col(m, "efficiency") if v is not None]) for m in OVERLAPPED
           if any(v is not None for v in col(m, "efficiency"))}
    out = {
        "samples_per_s": {n: round(s.median, 2) for n, s in sps.items()},
        "samples_per_s_range": {n: [round(s.lo, 2), round(s.hi, 2)] for n, s in sps.items()},
        "gen_tokens_per_s": {n: round(s.median, 1) for n, s in tps.items()},
        "useful_tokens_per_s": {n: round(s.median, 1) for n, s in uts.items()},
        **{key: {n: round(statistics.fmean(v for v in col(n, key) if v is not None), 2)
                 for n in names if any(v is not None for v in col(n, key))}
           for key in ("gen_tokens_per_row", "useful_tokens_per_row")},
        "sync_baseline": baseline, "trl_baseline": trl_base,
        **dict.fromkeys(HEADLINE_RATIOS),  # present even when not measured
        **{k: round(s.median, 3) for k, s in ratios.items()},
        "ratio_range": {k: [round(s.lo, 3), round(s.hi, 3)] for k, s in ratios.items()},
        "bound_samples_per_s": {m: round(s.median, 2) for m, s in bounds.items()},
        "efficiency_vs_bound": {m: round(s.median, 3) for m, s in eff.items()},
        "efficiency_range": {m: [round(s.lo, 3), round(s.hi, 3)] for m, s in eff.items()},
        "rows_per_step": rows_per_step,
        "peak_tree_rss_mb": {n: round(v, 1) for n, v in rss.items()},
    }
    for key, target in TARGETS.items():
        out[f"target_{key}_{target}_met"] = (ratios[key].median >= target) if key in ratios else None
    out["_spreads"] = {"samples_per_s": {n: s.as_json(2) for n, s in sps.items()},
                       "ratios": {k: s.as_json() for k, s in ratios.items()}}
    return out


# ---- the AsyncFlow runs -----------------------------------------------------------------------

def workload_overrides(a: argparse.Namespace) -> list[str]:
    """The RL job every mode runs (placement and mode apart)."""
    return [
        "algorithm.kl_coef=0.01", "algorithm.dynamic_sampling=false", f"optim.lr={a.lr}",
        "trainer.time_budget_s=0", f"trainer.steps={a.steps}", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.log_samples=true", f"trainer.prompts_per_step={a.prompts}", f"rollout.n={a.group}",
        f"rollout.batch_prompts={a.batch_prompts}", f"rollout.max_new_tokens={a.max_new_tokens}",
        f"trainer.seed={a.seed}", f"data.num_eval={a.num_eval}",
        *([f"{IGNORE_EOS_KEY}=true"] if a.lengths in ("fixed", "longtail") else []),
        *([f"{LENGTH_PROFILE_KEY}=longtail"] if a.lengths == "longtail" else []),
    ]


def warmup_overrides(a: argparse.Namespace) -> list[str]:
    """The main job's warm-up (warmup.* defaults: supervised steps until held-out accuracy reaches
    the target), in a run without RL steps; its exported policy starts every run."""
    return [f"trainer.seed={a.seed}", f"trainer.threads={WARMUP_THREADS}", f"data.num_eval={a.num_eval}",
            "trainer.steps=0", "trainer.eval_every=0", "trainer.time_budget_s=0", "trainer.progress=false"]


def start_from(model_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", "model.attn_implementation=eager", "warmup.enabled=false"]


def setting_overrides(mode: str, setting: Setting, a: argparse.Namespace) -> list[str]:
    """A mode's configuration: its threads and reward placement, and the reference model's
    ranks shared by every disaggregated mode (colocated puts every role everywhere)."""
    shared = [f"placement.ref_with={a.ref_with}"] if "placement.mode=disaggregated" in MODES[mode] else []
    return [f"trainer.threads={setting.threads}", f"placement.reward_with={setting.reward_with}", *shared]


def train(name: str, overrides: list[str], run_dir: Path, timeout_s: float,
          memory: dict | None = None) -> tuple[int | str, float, Path]:
    """One `asyncflow train grpo` subprocess into a fresh run_dir: (exit code, wall s, log)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # one directory holds one run (the HF export refuses to overwrite)
    run_dir.mkdir(parents=True)
    log_path = run_dir.parent / f"{name}.log"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", *overrides, f"trainer.out_dir={run_dir}"]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = run_group(cmd, log, timeout_s, memory)
    return rc, time.monotonic() - t0, log_path


def run_group(cmd: list[str], log, timeout_s: float, memory: dict | None = None,
              env: dict[str, str] | None = None) -> int | str:
    """Run cmd in its own process group; on timeout kill that group, so that the rank processes
    a hung run spawned do not keep loading the cores under the next runs. ``memory``, when
    given, receives the peak RSS of the command's process tree (TreeRSS)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    sampler = TreeRSS(proc.pid) if memory is not None else None
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the group this Popen made (start_new_session): pgid == its pid
        proc.wait()
        return "timeout"
    finally:
        if sampler is not None:
            memory.update(sampler.stop())


def warm_up(a: argparse.Namespace, out: Path) -> dict:
    """The shared warm-up, reused from an earlier bench run with the same settings."""
    wdir = out / "warmup"
    key = {"overrides": warmup_overrides(a), "recipe": str(RECIPE)}
    key_file = out / "warmup.key.json"
    if (not a.fresh_warmup and (wdir / "hf_model").is_dir() and (wdir / "summary.json").is_file()
            and key_file.is_file() and json.loads(key_file.read_text()) == key):
        s = json.loads((wdir / "summary.json").read_text())
        return {"model": str((wdir / "hf_model").resolve()), "warmup_steps": s.get("warmup_steps"),
                "accuracy": s.get("eval_accuracy_after_rl"), "wall_s": None, "reused": True}
    key_file.unlink(missing_ok=True)
    rc, wall, log = train("warmup", warmup_overrides(a), wdir, max(a.run_timeout_s, 600.0))
    if rc != 0 or not (wdir / "hf_model").is_dir():
        raise SystemExit(f"bench_e2e: the warm-up run failed (exit {rc}, {wall:.0f} s); see {log}: {tail(log)}")
    key_file.write_text(json.dumps(key))
    s = json.loads((wdir / "summary.json").read_text())
    return {"model": str((wdir / "hf_model").resolve()), "warmup_steps": s.get("warmup_steps"),
            "accuracy": s.get("eval_accuracy_after_rl"), "wall_s": round(wall, 1), "reused": False}


def run_mode(mode: str, setting: Setting, a: argparse.Namespace, parent: Path, model: Path,
             name: str | None = None) -> dict:
    """Run one mode in one configuration as its own `asyncflow train` subprocess, into
    parent/<name> (default: the mode's name); one retry on failure. A run that wrote its
    summary.json (the last thing `asyncflow train` writes before its report, after the RL phase
    and the final export) and then failed counts, its figures read as any run's, with the
    failure named beside them (``exit_after_summary``)."""
    name = name or mode
    overrides = [*workload_overrides(a), *start_from(model), *MODES[mode], *setting_overrides(mode, setting, a)]
    err = ""
    for attempt in (1, 2):
        memory: dict = {}
        rc, wall, log = train(name, overrides, parent / name, entry_timeout(mode, a.run_timeout_s), memory)
        if (parent / name / "summary.json").is_file():
            res = analyse(parent / name, a)
            res.update({"wall_s": wall, "attempts": attempt, "setting": setting.as_json(), **memory})
            if rc != 0:
                res["exit_after_summary"] = f"exit {rc} after the RL phase (log: {log}): {tail(log)}"
                print(f"    {name}: {res['exit_after_summary']}", flush=True)
            return res
        kept = log.with_name(f"{name}.attempt{attempt}.log")  # the retry writes a fresh log
        log.replace(kept)
        err = f"exit {rc} after {wall:.0f} s (log: {kept}): {tail(kept)}"
        print(f"    {name}: attempt {attempt} failed, {err}", flush=True)
    return {"error": err}


def tail(path: Path, n: int = 3) -> str:
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    hits = [x for x in lines if "exits:" in x or "Error" in x or "error" in x]
    return " | ".join((hits or lines)[-n:])[-400:]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def analyse(run_dir: Path, a: argparse.Namespace) -> dict:
    """One finished run's figures, from its summary.json, metrics.jsonl, timeline.jsonl and
    samples.jsonl. Rank-group costs follow the run's own placement (config.json)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_m = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "perf/samples_per_s" in m]
    n_steps = max(len(steps_m), 1)
    stage_s = {key[len("timing_s/"):]: sum(m.get(key, 0.0) for m in steps_m) / n_steps
               for key in sorted({k for m in steps_m for k in m if k.startswith("timing_s/")})}
    placement = json.loads((run_dir / "config.json").read_text())["placement"]
    spans = read_jsonl(run_dir / "timeline.jsonl")
    # The weight sync is timed after its step's metrics are logged: the actor rank's publish spans.
    stage_s["weight_sync"] = sum(s["end"] - s["start"] for s in spans
                                 if s["stage"] == "weight_sync" and s["lane"].endswith(" actor")) / n_steps
    lanes = {s["lane"].split()[0] for s in spans}
    groups = rank_groups(placement, stage_s, lanes)
    rows_per_step = a.prompts * a.group
    rows = read_jsonl(run_dir / "samples.jsonl")
    responses = [row["response_ids"] for row in rows]
    lengths = [len(r) for r in responses]
    if a.lengths == "fixed":
        check_fixed_lengths(lengths, a.max_new_tokens, str(run_dir))
    if a.lengths == "longtail":
        check_targets(rows, row_targets(a.seed, a.max_new_tokens, a.steps * a.prompts, a.group), a.seed, str(run_dir))
    rl_s = summary["rl_s"]
    gen = generated_tokens(responses)
    return {
        "samples_per_s": summary["samples_per_s"], "rl_s": rl_s, "steps": summary["rl_steps"],
        "rows": len(lengths), "gen_tokens": gen, "gen_tokens_per_s": gen / rl_s if rl_s > 0 else None,
        "gen_tokens_per_row": gen / len(lengths) if lengths else None,
        # every generated token is trained: AsyncFlow stops each row at its own budget
        "useful_tokens": gen, "useful_tokens_per_s": gen / rl_s if rl_s > 0 else None,
        "useful_tokens_per_row": gen / len(lengths) if lengths else None,
        "tokens_per_s_with_prompts": summary["tokens_per_s"],
        "stage_s_per_step": stage_s, "group_s_per_step": group_costs(spans, groups, n_steps),
        "rank_busy_s_per_step": {r: union_s([s for s in spans if s["lane"].split()[0] == r]) / n_steps
                                 for r in sorted(lanes)},
        "idle_ratio": summary.get("idle_ratio", {}), "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"],
        "accuracy_before": summary.get("eval_accuracy_before_rl"),
        "accuracy_after": summary.get("eval_accuracy_after_rl"),
        "response_len": length_stats(lengths, a.max_new_tokens),
        # t: seconds since the RL phase began (the first step's end less its duration)
        "reward_curve": [{"samples": (i + 1) * rows_per_step, "reward": m.get("reward/mean"),
                          "t": m["time_s"] - steps_m[0]["time_s"] + steps_m[0].get("step_time_s", 0.0)}
                         for i, m in enumerate(steps_m)],
    }


def standalone_setting(mode: str, setting: Setting, cpus: int) -> Setting:
    """The configuration of the stand-alone run that bounds ``mode`` in ``setting``: the sync
    mode (stages one after another) on the same placement with the same threads per rank."""
    return Setting(resolved_threads(mode, setting.threads, cpus), setting.reward_with)


def same_setting(mode_a: str, a: Setting, mode_b: str, b: Setting, cpus: int) -> bool:
    """The two run with the same threads per rank and the same reward placement."""
    return (a.reward_with == b.reward_with
            and resolved_threads(mode_a, a.threads, cpus) == resolved_threads(mode_b, b.threads, cpus))


def median_costs(runs: Sequence[dict]) -> dict[str, float] | None:
    """Each rank group's cost per step, the median over stand-alone runs of one configuration."""
    costs = [r["group_s_per_step"] for r in runs if "group_s_per_step" in r]
    return {g: statistics.median(c[g] for c in costs) for g in costs[0]} if costs else None


def add_bounds(rep: dict[str, dict], rows_per_step: int, standalone: dict[str, dict[str, float]]) -> None:
    """Bound and efficiency of each overlapped run from the stand-alone costs of its placement
    (``standalone``: mode -> group costs, measured in runs outside the repetitions)."""
    for name in OVERLAPPED:
        r, base = rep.get(name, {}), standalone.get(name)
        if "group_s_per_step" not in r or not base:
            continue
        r["standalone_group_s_per_step"] = base
        try:
            r["bound_samples_per_s"] = overlapped_bound(rows_per_step, base, r["group_s_per_step"])
        except ValueError as e:  # reported beside the run, the other figures stand
            r["bound_error"] = str(e)
            continue
        r["efficiency"] = r["samples_per_s"] / r["bound_samples_per_s"]


# ---- the TRL peer ---------------------------------------------------------------------------

def trl_python(venv: Path = TRL_VENV) -> Path:
    return venv / "bin" / "python"


def trl_ready(venv: Path = TRL_VENV) -> bool:
    py = trl_python(venv)
    if not py.is_file():
        return False
    if venv == TRL_VLLM_VENV:  # transformers is vLLM's pin there
        check = (f"import trl, vllm, torch; assert trl.__version__ == {TRL!r}; "
                 f"assert torch.__version__.startswith({TORCH!r})")
    else:
        check = (f"import trl, transformers, torch; assert trl.__version__ == {TRL!r}; "
                 f"assert transformers.__version__ == {TRANSFORMERS!r}; assert torch.__version__.startswith({TORCH!r})")
    return subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0


def vllm_constraints(requirements: str) -> str:
    """pip constraints from requirements-vllm-cpu.txt: its pins (comments and editable lines
    dropped), torch added, so that TRL's own dependencies resolve around vLLM's."""
    pins = [line.strip() for line in requirements.splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "-e"))]
    return "\n".join([*pins, f"torch=={TORCH}"]) + "\n"


def run_steps(what: str, steps: list[list[str]], log_path: Path) -> str | None:
    """Run the install commands in order, output to ``log_path``; the first failure, or None."""
    with open(log_path, "w") as log:
        for cmd in steps:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                return f"{what}: `{' '.join(cmd)}` failed ({rc}); see {log_path}"
    return None


def ensure_trl_vllm_venv(log_path: Path) -> str | None:
    """Make perf/.venv-trl-vllm (vllm-cpu with its pins, then TRL within them) unless it already
    works; None or the error."""
    if trl_ready(TRL_VLLM_VENV):
        return None
    print(f"  making the TRL + vLLM venv {TRL_VLLM_VENV} (trl=={TRL} over {VLLM_REQUIREMENTS.name}) ...", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(vllm_constraints(VLLM_REQUIREMENTS.read_text()))
        constraints = f.name
    pip = [str(TRL_VLLM_VENV / "bin" / "pip"), "install", "-q"]
    steps = [[sys.executable, "-m", "venv", str(TRL_VLLM_VENV)], [*pip, f"torch=={TORCH}"],
             [*pip, "--no-deps", "-r", str(VLLM_REQUIREMENTS)],
             [*pip, "-c", constraints, f"trl=={TRL}", "datasets", "accelerate"]]
    failed = run_steps("TRL + vLLM venv", steps, log_path)
    os.unlink(constraints)
    if failed:
        return failed
    return None if trl_ready(TRL_VLLM_VENV) else f"TRL + vLLM venv made but trl {TRL} / vllm do not import"


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
    failed = run_steps("TRL venv", steps, log_path)
    os.unlink(constraints)
    if failed:
        return failed
    return None if trl_ready() else f"TRL venv made but trl {TRL} / transformers {TRANSFORMERS} do not import"


def trl_spec(a: argparse.Namespace, model: Path) -> dict:
    """TRL's job: the prompts the AsyncFlow runs train on (the first steps x prompts of the same
    stream, with their token ids), and the optimisation settings of AsyncFlow's GRPO."""
    from asyncflow.config import load_config
    from asyncflow.data.addition import addition_record
    from asyncflow.data.run_data import build_prompt_data

    cfg = load_config(RECIPE, [*workload_overrides(a), *start_from(model)])
    it = build_prompt_data(cfg, str(model)).train_records()
    recs = [next(it) for _ in range(a.steps * a.prompts)]
    return {"model": str(model), "prompts": [addition_record(int(r["index"]))["prompt"] for r in recs],
            "prompt_ids": [[int(t) for t in r["prompt_ids"]] for r in recs],
            "answers": [str(r["answer"]) for r in recs], "steps": a.steps, "prompts_per_step": a.prompts,
            "group_size": a.group, "max_completion_length": a.max_new_tokens, "fixed_length": a.lengths == "fixed",
            "beta": cfg.algorithm.kl_coef, "lr": cfg.optim.lr, "lr_warmup_steps": cfg.optim.warmup_steps,
            "grad_clip": cfg.optim.grad_clip, "temperature": cfg.rollout.temperature, "seed": a.seed,
            # longtail: each row's target length, [prompt position in the stream][sample]: AsyncFlow's budgets
            "row_targets": (row_targets(a.seed, a.max_new_tokens, len(recs), a.group)
                            if a.lengths == "longtail" else None)}


def run_trl(entry: str, setting: Setting, spec: dict, a: argparse.Namespace, parent: Path,
            name: str | None = None) -> dict:
    """One TRL run (entry trl, or trl_vllm generating with vLLM) into parent/<name>."""
    name = name or entry
    use_vllm = entry == TRL_VLLM
    run_dir = parent / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec_path, res_path, log_path = run_dir / "spec.json", run_dir / "result.json", parent / f"{name}.log"
    spec_path.write_text(json.dumps({**spec, "threads": setting.threads, "out_dir": str(run_dir / "trainer"),
                                     "use_vllm": use_vllm}))
    python = trl_python(TRL_VLLM_VENV if use_vllm else TRL_VENV)
    t0 = time.monotonic()
    memory: dict = {}
    with open(log_path, "w") as log:
        rc = run_group([str(python), str(ROOT / "perf" / "_trl_peer.py"), str(spec_path), str(res_path)],
                       log, entry_timeout(entry, a.run_timeout_s), memory)
    if rc != 0 or not res_path.is_file():
        return {"error": f"TRL run exit {rc} (log: {log_path}): {tail(log_path)}"}
    res = {**json.loads(res_path.read_text()), **memory}
    rows = max(res["steps"] * res["rows_per_step"], 1)
    res.update({"wall_s": time.monotonic() - t0, "setting": setting.as_json(),
                "gen_tokens_per_row": res["gen_tokens"] / rows, "useful_tokens_per_row": res["useful_tokens"] / rows})
    return res


# ---- report ---------------------------------------------------------------------------------

def code_version() -> dict | None:
    """The commit measured, and the files that differed from it (others may be editing the tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    try:
        return {"commit": git("rev-parse", "--short", "HEAD").strip(),
                "changed": [line[3:] for line in git("status", "--porcelain").splitlines()]}
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout

STYLE = {"async": ("tab:red", "-"), "sync_colocated": ("tab:blue", "-"), "sync": ("tab:blue", "--"),
         "stream": ("tab:green", ":"), TRL_ENTRY: ("tab:gray", "-."), "async_vllm": ("tab:purple", "-"),
         TRL_VLLM: ("tab:olive", "-.")}


def plot(reps: list[dict[str, dict]], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (color, ls) in STYLE.items():
        for k, rep in enumerate(reps):
            curve = [p for p in rep.get(name, {}).get("reward_curve", []) if p["reward"] is not None]
            if not curve:
                continue
            label = name if k == 0 else None
            left.plot([p["samples"] for p in curve], [p["reward"] for p in curve], ls, color=color, alpha=0.7,
                      marker=".", ms=3, label=label)
            right.plot([p["t"] for p in curve], [p["reward"] for p in curve], ls, color=color, alpha=0.7,
                       marker=".", ms=3, label=label)
    left.set(xlabel="samples seen", ylabel="reward/mean", title="reward per sample")
    right.set(xlabel="RL wall time (s)", ylabel="reward/mean", title="reward against time")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fmt(x: float | None, spec: str = ".2f") -> str:
    """format(x, spec), or a dash as wide as the spec asks."""
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def median_of(reps: list[dict[str, dict]], name: str, key: str) -> float | None:
    vals = [r[name][key] for r in reps if key in r.get(name, {}) and r[name][key] is not None]
    return statistics.median(vals) if vals else None


def print_table(reps: list[dict[str, dict]], names: list[str], summary: dict) -> None:
    print(f"\n{'mode':15} {'config':22} {'samples/s':>9} {'range':>15} {'gen tok/s':>9} {'tok/row':>7} "
          f"{'useful/s':>9} {'use/row':>7} {'bound':>7} {'eff':>5} "
          f"{'stale':>5} " + " ".join(f"{s[:9]:>9}" for s in STAGES))
    for name in names:
        ok = [r[name] for r in reps if "samples_per_s" in r.get(name, {})]
        errs = [r[name]["error"] for r in reps if "error" in r.get(name, {})]
        if not ok:
            print(f"{name:15} {summary['settings'].get(name, {}).get('label', ''):22} "
                  f"FAILED: {errs[0] if errs else 'not run'}")
            continue
        rng = summary["samples_per_s_range"].get(name, [None, None])
        stages = " ".join(fmt(statistics.median(r["stage_s_per_step"].get(s, 0.0) for r in ok), "9.3f")
                          for s in STAGES) if "stage_s_per_step" in ok[0] else ""
        print(f"{name:15} {summary['settings'].get(name, {}).get('label', ''):22} "
              f"{fmt(median_of(reps, name, 'samples_per_s'), '9.1f')} "
              f"{'[' + fmt(rng[0], '.1f') + ', ' + fmt(rng[1], '.1f') + ']':>15} "
              f"{fmt(median_of(reps, name, 'gen_tokens_per_s'), '9.1f')} "
              f"{fmt(median_of(reps, name, 'gen_tokens_per_row'), '7.2f')} "
              f"{fmt(median_of(reps, name, 'useful_tokens_per_s'), '9.1f')} "
              f"{fmt(median_of(reps, name, 'useful_tokens_per_row'), '7.2f')} "
              f"{fmt(median_of(reps, name, 'bound_samples_per_s'), '7.1f')} "
              f"{fmt(median_of(reps, name, 'efficiency'), '5.2f')} "
              f"{fmt(median_of(reps, name, 'staleness_mean'), '5.2f')} {stages}"
              + (f"  ({len(errs)} failed)" if errs else ""))
    rss = summary.get("peak_tree_rss_mb", {})
    if rss:
        print("peak RSS of each run's process tree (MB, median): "
              + ", ".join(f"{n} {v:.0f}" for n, v in rss.items()))
    print("(medians over the repetitions; config: the entry's configuration in them; stage columns: busy seconds "
          f"per step; bound: ideal samples/s from the stage costs of a '{STANDALONE}' run on the same placement and "
          "threads, outside the repetitions; eff = samples/s / bound)")


def int_list(text: str) -> list[int]:
    return [int(t) for t in str(text).split(",") if t.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 steps per run (the sweep's and the repetitions'); the "
                    "warm-up is cached in --out")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "bench_e2e"))
    ap.add_argument("--reps", type=int, default=0,
                    help="repetitions of the judged runs (0: as few as balance allows). Raised to the smallest "
                         "multiple of the entries at or above max(--reps, 3), so that every entry takes every "
                         "position equally often (said when raised)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default 16 quick, 48 full); "
                    "the overlapped modes' pipeline fill and drain weigh on their samples/s as about one step "
                    "in 'steps', and the first step's one-time costs as a fixed sum in every mode")
    ap.add_argument("--sweep-steps", type=int, default=None, help="RL steps of each sweep run (default: --steps)")
    ap.add_argument("--sweep-passes", type=int, default=2,
                    help="runs of each configuration in the sweep (each pass in the opposite order); a mode's "
                         "best is the highest median over them (default 2: one slow run on a shared machine "
                         "no longer decides an entry's configuration alone)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="no sweep: every entry runs at the first value of --threads / --reward-with / "
                         "--trl-threads (the stand-alone runs that bound stream and async still run)")
    ap.add_argument("--threads", default="0,1,2",
                    help="torch threads per AsyncFlow rank to sweep (comma-separated; 0: auto, the product's "
                         "rule: every core in sync disaggregated, the cores shared out among the ranks otherwise); "
                         "counts that resolve to the same number are run once")
    ap.add_argument("--reward-with", default=",".join(REWARD_PLACEMENTS),
                    help="placement.reward_with values to sweep (comma-separated, of " + ", ".join(REWARD_PLACEMENTS)
                         + "; colocated runs actor and rollout once: the same ranks)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    ap.add_argument("--ref-with", choices=("actor", "rollout"), default=REF_WITH,
                    help="disaggregated modes: the ranks the reference model shares")
    ap.add_argument("--batch-prompts", type=int, default=16,
                    help="prompts per rollout call in stream/async (sync: the whole step per call)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="natural: the length cap; fixed: every row's length; longtail: the cap of the targets "
                         "(default " + ", ".join(f"{k} {v}" for k, v in DEFAULT_CAP.items()) + "), both sides")
    ap.add_argument("--lengths", choices=LENGTHS, default="natural",
                    help="natural: rows stop at EOS or at the cap; fixed: EOS ignored, every row at the cap "
                         "(AsyncFlow's rollout.ignore_eos); longtail: the long-tailed workload, every row runs to "
                         "its own seeded target, the same targets on both sides (see the docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=DEFAULT_LR,
                    help=f"the RL learning rate, both sides (default {DEFAULT_LR:g}: at the main job's 3e-4 this "
                         "workload's held-out accuracy falls)")
    ap.add_argument("--trl-threads", default="2,1",
                    help="torch threads of the TRL process to sweep (comma-separated): its one process with 2 "
                         "threads uses both cores, but on a shared machine a second thread that loses its core "
                         "stalls every parallel op")
    ap.add_argument("--num-eval", type=int, default=256,
                    help="held-out prompts: the warm-up's stopping check and the before/after RL accuracy")
    ap.add_argument("--modes", default=",".join(BUILTIN_MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--vllm", action="store_true",
                    help="add the main job on vLLM (async_vllm: rollout.engine=vllm) and TRL generating with vLLM "
                         "(trl_vllm, --trl-vllm-threads swept); needs vLLM importable: run with the vLLM venv's python")
    ap.add_argument("--trl-vllm-threads", default="1",
                    help="with --vllm: torch threads of TRL's vLLM entry to sweep (comma-separated; empty: none)")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL peer")
    ap.add_argument("--fresh-warmup", action="store_true", help="redo the warm-up even if a matching one is cached")
    ap.add_argument("--fault", type=int, default=0,
                    help="instead of the modes: the async job on 1 training rank and 2 rollout instances with one "
                         "instance killed every FAULT RL steps, against the same job with none (perf/_fault_bench.py)")
    ap.add_argument("--fault-eval-every", type=int, default=4, help="with --fault: held-out evaluation every N steps")
    ap.add_argument("--fault-thresholds", default="0.3,0.5",
                    help="with --fault: the held-out accuracies whose RL time to reach is reported")
    ap.add_argument("--run-timeout-s", type=float, default=None,
                    help="kill a run after this long, then retry it once (default 150 quick, 300 quick longtail, "
                         "600 full: a hung run would otherwise hold the bench for minutes)")
    a = ap.parse_args(argv)
    if a.steps is None:
        a.steps = 16 if a.quick else 48
    if a.sweep_steps is None:
        a.sweep_steps = a.steps
    if a.max_new_tokens is None:
        a.max_new_tokens = DEFAULT_CAP[a.lengths]
    if a.run_timeout_s is None:
        a.run_timeout_s = (300.0 if a.lengths == "longtail" else 150.0) if a.quick else 600.0
    if a.fault < 0 or a.fault_eval_every < 1:
        ap.error(f"--fault {a.fault} / --fault-eval-every {a.fault_eval_every}: need >= 0 and >= 1")
    if a.reps < 0 or a.sweep_passes < 1:
        ap.error(f"--reps {a.reps} / --sweep-passes {a.sweep_passes}: need >= 0 and >= 1")
    try:
        a.modes_list = select_modes(a.modes, a.vllm)
        a.threads_list = int_list(a.threads)
        a.reward_list = [r for r in str(a.reward_with).split(",") if r.strip()]
        a.trl_list = [] if a.no_trl else [s.threads for s in trl_settings(int_list(a.trl_threads))]
        a.trl_vllm_list = ([] if a.no_trl or not a.vllm or not str(a.trl_vllm_threads).strip() else
                           [s.threads for s in trl_settings(int_list(a.trl_vllm_threads), vllm=True)])
        mode_settings("sync", a.threads_list, a.reward_list, 2)  # the lists are checked before anything runs
    except ValueError as e:
        ap.error(str(e))
    if a.lengths == "longtail" and a.trl_vllm_list:
        ap.error("--lengths longtail: TRL's vLLM entry takes one length budget for all rows (per-row targets are "
                 "applied on its transformers path only); leave --trl-vllm-threads empty")
    if any(m in VLLM_MODES for m in a.modes_list):
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            ap.error(f"{', '.join(m for m in a.modes_list if m in VLLM_MODES)} need vLLM importable, and this python "
                     f"({sys.executable}) has none: run the bench with the vLLM venv's python, or leave --vllm out")
    return a


def run_entry(entry: str, setting: Setting, a: argparse.Namespace, parent: Path, model: Path, spec: dict | None,
              name: str | None = None) -> dict:
    """One run of an entry (a mode, or TRL) in one configuration; a failure is reported, never faked."""
    try:
        if entry in (TRL_ENTRY, TRL_VLLM):
            return run_trl(entry, setting, spec, a, parent, name)
        return run_mode(entry, setting, a, parent, model, name)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def one_line(r: dict) -> str:
    if "error" in r:
        return f"FAILED {r['error']}"
    return (f"{r['samples_per_s']:.1f} samples/s, {fmt(r.get('gen_tokens_per_s'), '.0f')} gen tok/s "
            f"({r['gen_tokens_per_row']:.2f}/row), {fmt(r.get('useful_tokens_per_s'), '.0f')} useful tok/s "
            f"({fmt(r.get('useful_tokens_per_row'), '.2f')}/row), peak RSS {fmt(r.get('peak_tree_rss_mb'), '.0f')} MB")


def choice_key(entry: str) -> str:
    """What a sweep maximises: TRL is judged by useful tokens/s, the modes by samples/s."""
    return "useful_tokens_per_s" if entry.startswith(TRL_PREFIX) else "samples_per_s"


def sweep(settings: dict[str, list[Setting]], a: argparse.Namespace, out: Path, model: Path,
          spec: dict | None) -> dict[str, dict[str, list[dict]]]:
    """Every configuration of each entry with more than one, run --sweep-passes times at
    --sweep-steps, into out/sweep/pass<p>/: {entry: {label: [result per pass]}}."""
    sa = argparse.Namespace(**{**vars(a), "steps": a.sweep_steps})
    runs = sweep_order({e: ss for e, ss in settings.items() if len(ss) > 1}, a.sweep_passes)
    results: dict[str, dict[str, list[dict]]] = {}
    for k, (entry, setting) in enumerate(runs):
        p = k // max(len(runs) // a.sweep_passes, 1)
        t = time.monotonic()
        r = run_entry(entry, setting, sa, out / "sweep" / f"pass{p}", model, spec, f"{entry}-{setting.label}")
        results.setdefault(entry, {}).setdefault(setting.label, []).append(r)
        print(f"  sweep {k + 1}/{len(runs)} {entry} {setting.label}: {one_line(r)} ({time.monotonic() - t:.0f} s)",
              flush=True)
    return results


def sweep_json(results: dict[str, list[dict]], key: str) -> dict:
    return {label: {"samples_per_s": [r.get("samples_per_s") for r in runs],
                    "useful_tokens_per_s": [r.get("useful_tokens_per_s") for r in runs],
                    "chosen_by": key, "errors": [r["error"] for r in runs if "error" in r]}
            for label, runs in results.items()}


def standalone_costs(chosen: dict[str, Setting], swept: dict[str, dict[str, list[dict]]],
                     settings: dict[str, list[Setting]], a: argparse.Namespace, out: Path, model: Path,
                     cpus: int) -> tuple[dict[str, dict[str, float]], dict]:
    """The stage costs that bound each overlapped mode: from the sweep's sync runs on the same
    placement and threads when it has them, else from a sync run of that configuration made
    now (out/standalone/); never from the runs they judge. (mode -> costs, what each came from)."""
    costs: dict[str, dict[str, float]] = {}
    made: dict[str, list[dict]] = {}
    info: dict = {}
    for mode in (m for m in OVERLAPPED if m in chosen):
        want = standalone_setting(mode, chosen[mode], cpus)
        found = [s for s in settings.get(STANDALONE, [])
                 if s.label in swept.get(STANDALONE, {}) and same_setting(STANDALONE, s, STANDALONE, want, cpus)]
        if found:
            runs, source = swept[STANDALONE][found[0].label], f"sweep: {STANDALONE} {found[0].label}"
        else:
            if want.label not in made:
                t = time.monotonic()
                r = run_entry(STANDALONE, want, a, out / "standalone", model, None, f"{STANDALONE}-{want.label}")
                made[want.label] = [r]
                print(f"  stand-alone {STANDALONE} {want.label} (bounds {mode}): {one_line(r)} "
                      f"({time.monotonic() - t:.0f} s)", flush=True)
            runs, source = made[want.label], f"own run: {STANDALONE} {want.label}"
        c = median_costs(runs)
        info[mode] = {"source": source, "runs": len(runs), "group_s_per_step": c,
                      "errors": [r["error"] for r in runs if "error" in r]}
        if c:
            costs[mode] = c
    return costs, info


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = a.prompts * a.group
    code = code_version()
    from asyncflow.config import usable_cpus
    cpus = usable_cpus()

    warm = warm_up(a, out)
    model = Path(warm["model"])
    print(f"warm-up: {warm['warmup_steps']} supervised steps, held-out accuracy {fmt(warm['accuracy'], '.3f')}"
          + (" (cached)" if warm["reused"] else f", {warm['wall_s']:.0f} s"), flush=True)
    if a.fault:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _fault_bench import run_fault_bench
        run_fault_bench(a, out, model, train, start_from, workload_overrides(a))
        print(f"bench_e2e --fault: {out / 'fault' / 'results.json'}", flush=True)
        return
    settings = {m: mode_settings(m, a.threads_list, a.reward_list, cpus) for m in a.modes_list}
    errors: dict[str, str] = {}
    spec = sweep_spec = None
    for entry, threads, make, log_name in ((TRL_ENTRY, a.trl_list, ensure_trl_venv, "trl_install.log"),
                                           (TRL_VLLM, a.trl_vllm_list, ensure_trl_vllm_venv, "trl_vllm_install.log")):
        if not threads:
            continue
        err = make(out / log_name)
        if err:
            errors[entry] = err
            print(f"  TRL entry {entry} skipped: {err}", flush=True)
            continue
        spec = spec or trl_spec(a, model)
        sweep_spec = sweep_spec or (trl_spec(argparse.Namespace(**{**vars(a), "steps": a.sweep_steps}), model)
                                    if a.sweep_steps != a.steps else spec)
        settings[entry] = trl_settings(threads, vllm=entry == TRL_VLLM)
    if a.no_sweep:
        settings = {e: ss[:1] for e, ss in settings.items()}
    targets = (row_targets(a.seed, a.max_new_tokens, a.steps * a.prompts, a.group)
               if a.lengths == "longtail" else None)
    print(f"workload: GRPO + reference (kl_coef 0.01) + reward from the warmed-up tiny model, addition task; "
          f"{a.steps} steps x {a.prompts} prompts x {a.group} = {rows} rows/step, lr {a.lr:g}; lengths {a.lengths} "
          f"(cap {a.max_new_tokens}"
          + (f"; targets: mean {statistics.fmean(x for t in targets for x in t):.1f}, median "
             f"{statistics.median(x for t in targets for x in t):.0f} tokens" if targets else "")
          + f"); rollout calls of {a.batch_prompts} prompts (stream/async); disaggregated: reference with the "
          f"{a.ref_with} rank", flush=True)

    swept: dict[str, dict[str, list[dict]]] = {}
    if any(len(ss) > 1 for ss in settings.values()):
        n = sum(len(ss) for ss in settings.values() if len(ss) > 1) * a.sweep_passes
        print(f"sweep: {n} runs of {a.sweep_steps} steps: "
              + "; ".join(f"{e} {', '.join(s.label for s in ss)}" for e, ss in settings.items() if len(ss) > 1),
              flush=True)
        swept = sweep(settings, a, out, model, sweep_spec)
    chosen: dict[str, Setting] = {}
    for entry, ss in settings.items():
        if len(ss) == 1:
            chosen[entry] = ss[0]
            continue
        try:
            label = choose(swept[entry], choice_key(entry))
        except ValueError as e:
            errors[f"sweep/{entry}"] = str(e)
            print(f"  {entry}: left out, {e}", flush=True)
            continue
        chosen[entry] = next(s for s in ss if s.label == label)
    print("chosen: " + ", ".join(f"{e} {s.label}" for e, s in chosen.items()), flush=True)
    bounds, standalone_info = standalone_costs(chosen, swept, settings, a, out, model, cpus)

    entries = list(chosen)
    if not entries:
        raise SystemExit("bench_e2e: no entry left to measure (every sweep configuration failed)")
    reps_n = balanced_reps(a.reps, len(entries))
    if reps_n != a.reps:
        print(f"  {reps_n} repetitions (asked {a.reps}): the smallest multiple of the {len(entries)} entries at or "
              "above max(--reps, 3), so that each entry takes each position equally often", flush=True)
    orders = balanced_orders(entries, reps_n)
    carry = carryover_balanced(orders)
    if not carry:
        print(f"  note: {reps_n} repetitions do not put each entry after each other equally often (a multiple "
              f"of {len(williams_design(len(entries)))} does)", flush=True)
    reps: list[dict[str, dict]] = []
    for k, order in enumerate(orders):
        rep: dict[str, dict] = {}
        print(f"rep {k}: {' '.join(order)}", flush=True)
        for name in order:
            t = time.monotonic()
            rep[name] = run_entry(name, chosen[name], a, out / f"rep{k}", model, spec)
            print(f"  {name}: {one_line(rep[name])} ({time.monotonic() - t:.0f} s)", flush=True)
        add_bounds(rep, rows, bounds)
        reps.append(rep)

    summary = summarise(reps, rows)
    summary["settings"] = {
        e: {**s.as_json(), "resolved_threads": (s.threads if e.startswith(TRL_PREFIX)
                                                else resolved_threads(e, s.threads, cpus)),
            "chosen_by": ("the only configuration" if len(settings[e]) == 1 else
                          f"sweep: highest median {choice_key(e)} over {a.sweep_passes} pass(es) of "
                          f"{a.sweep_steps} steps, runs apart from the repetitions")}
        for e, s in chosen.items()}
    print_table(reps, entries, summary)
    for name in entries:
        ok = [r[name] for r in reps if "response_len" in r.get(name, {})]
        if ok:
            L = ok[0]["response_len"]
            acc = ", ".join(f"{fmt(r.get('accuracy_before'), '.3f')}->{fmt(r.get('accuracy_after'), '.3f')}"
                            for r in ok if r.get("accuracy_before") is not None)
            print(f"  {name}: rep 0 response length mean {L['mean']:.2f}, p50 {L['p50']}, p90 {L['p90']}, max "
                  f"{L['max']}, {100 * L['at_cap']:.1f}% at the cap" + (f"; held-out accuracy {acc}" if acc else ""))
    png = None
    try:
        png = plot(reps, out / "reward_curves.png", f"GRPO from the warmed-up tiny model, {a.steps} steps x {rows} "
                   f"rows, lengths {a.lengths} (cap {a.max_new_tokens}), {reps_n} repetitions")
        print(f"reward curves: {png}")
    except Exception as e:  # noqa: BLE001
        print(f"reward curves: not drawn ({type(e).__name__}: {e})")
    for k, rep in enumerate(reps):
        for name, r in rep.items():
            if "error" in r:
                errors[f"rep{k}/{name}"] = r["error"]
    spreads = summary.pop("_spreads")
    summary.update({
        "workload": LONGTAIL_WORKLOAD if a.lengths == "longtail" else f"lengths_{a.lengths}",
        "reps": reps_n, "reps_requested": a.reps, "orders": orders, "orders_balanced": positions_balanced(orders),
        "carryover_balanced": carry, "steps": a.steps, "lr": a.lr, "max_new_tokens": a.max_new_tokens,
        "lengths": a.lengths,
        "longtail_targets": ({"cap": a.max_new_tokens, "rows": sum(len(t) for t in targets),
                              "tokens": sum(map(sum, targets)),
                              "mean": round(statistics.fmean(x for t in targets for x in t), 2),
                              "median": statistics.median(x for t in targets for x in t),
                              "at_cap": round(sum(x == a.max_new_tokens for t in targets for x in t)
                                              / sum(len(t) for t in targets), 4)} if targets else None),
        "sweep": {e: {"chosen": chosen[e].label if e in chosen else None, "configs": sweep_json(r, choice_key(e))}
                  for e, r in swept.items()},
        "standalone_for_bounds": standalone_info,
        "warmup": {k: warm[k] for k in ("warmup_steps", "accuracy", "reused")},
        "trl": ({"version": TRL, "gradient_checkpointing": False} if spec else None),
        "vllm": ({"engine_kwargs": VLLM_ENGINE_KWARGS, "modes": [m for m in a.modes_list if m in VLLM_MODES]}
                 if any(m in VLLM_MODES for m in a.modes_list) else None),
        "code": code, "errors": errors, "reward_png": str(png) if png else None,
        "wall_s": round(time.monotonic() - t0, 1),
    })
    args = dict(vars(a))
    (out / "results.json").write_text(json.dumps({"summary": summary, "spreads": spreads, "reps": reps,
                                                  "sweep_runs": swept, "args": args}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
