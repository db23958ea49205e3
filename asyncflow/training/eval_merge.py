"""The held-out evaluation split over the rollout instances and merged back, and the sampled
evaluation's estimators (pass@k, mean@n).

Each instance evaluates a share of the prompts (``split_prompts``) and replies with its greedy
accuracy over that share and, with sampling on, the number of correct samples per prompt;
``merge_evaluations`` weighs every share by its prompts, so that the merged figures are those
of one instance evaluating all prompts, whatever the order the replies come back in.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(samples: int, ks: Sequence[int]) -> list[int]:
    """The k of the logged pass@k: ``trainer.eval_k``, or 1 and ``samples`` when it is empty."""
    return sorted(set(ks)) if ks else sorted({1, samples})


def split_prompts(count: int, parts: int) -> list[list[int]]:
    """Prompt indices 0..count-1 dealt round-robin to ``parts`` instances (every index exactly once;
    shares differ by at most one prompt, and a hard stretch of the list is shared out)."""
    if parts < 1:
        raise ValueError(f"cannot split {count} prompts over {parts} rollout instances")
    return [list(range(p, count, parts)) for p in range(parts)]


def _weighted(replies: Sequence[tuple[int, dict]], key: str) -> float | None:
    got = [(n, float(r[key])) for n, r in replies if key in r]
    total = sum(n for n, _ in got)
    return sum(n * v for n, v in got) / total if total else None


def merge_evaluations(parts: Sequence[Sequence[int]], replies: Sequence[dict], samples: int = 0,
                      ks: Sequence[int] = ()) -> dict[str, Any]:
    """One evaluation from the instances' replies (``replies[i]`` evaluated the prompts ``parts[i]``).

    Means (accuracy, the reward extras, the episode figures) are weighted by the prompts of each
    share; counts (reward errors and timeouts) are summed; ``version`` is the oldest. With
    ``samples`` > 0 each reply's ``correct`` holds the correct samples of each of its prompts and
    ``sample_score_sums`` the sum of their scores: ``pass@k`` is the mean over prompts of the
    unbiased estimate (pass@1: the mean correctness), ``mean@<samples>`` the mean score of all
    samples (verl's mean@N; the same as pass@1 for a 0/1 reward, above it with partial credit).
    """
    if len(parts) != len(replies):
        raise ValueError(f"{len(replies)} evaluation replies for {len(parts)} shares of the prompts")
    sized = [(len(p), r) for p, r in zip(parts, replies)]
    out: dict[str, Any] = {
        "accuracy": _weighted(sized, "accuracy") or 0.0,
        "version": min(int(r["version"]) for r in replies),
        "reward_errors": sum(int(r.get("reward_errors", 0)) for r in replies),
        "reward_timeouts": sum(int(r.get("reward_timeouts", 0)) for r in replies),
        "examples": [e for r in replies for e in r.get("examples", [])],
    }
    for key in ("turns_mean", "tool_calls_per_episode"):
        value = _weighted(sized, key)
        if value is not None:
            out[key] = value
    extra_keys = sorted({k for r in replies for k in dict(r.get("reward_extra") or {})})
    out["reward_extra"] = {k: _weighted([(n, r["reward_extra"]) for n, r in sized
                                         if k in dict(r.get("reward_extra") or {})], k) for k in extra_keys}
    if samples > 0:
        correct: dict[int, int] = {}
        score_sums: dict[int, float] = {}
        for part, reply in zip(parts, replies):
            counts, sums = list(reply["correct"]), list(reply["sample_score_sums"])
            if not len(counts) == len(sums) == len(part):
                raise ValueError(f"an instance returned {len(counts)} sample counts and {len(sums)} score sums "
                                 f"for {len(part)} prompts")
            correct.update(zip(part, (int(c) for c in counts)))
            score_sums.update(zip(part, (float(x) for x in sums)))
        n_prompts = max(len(correct), 1)
        for k in pass_ks(samples, ks):
            out[f"pass@{k}"] = sum(pass_at_k(samples, c, k) for c in correct.values()) / n_prompts
        out[f"mean@{samples}"] = sum(score_sums.values()) / (n_prompts * samples)
    return out
