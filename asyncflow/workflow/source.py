"""The prompt source: turns dataset records into the rows of a step, n rows per prompt.

Every row carries its own sampling seed, derived from the run seed, the prompt's
position in the stream and the sample's index in its group, so a response does not
depend on how rows are batched (sync and stream see the same samples).

An optional ``budget_fn(uid, j)`` gives each row its own token budget, written as the
``max_new_tokens`` column (benchmarks: ``rollout.length_profile=longtail``).
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Iterator

import torch


def row_seed(run_seed: int, prompt_uid: int, j: int) -> int:
    return (run_seed * 1_000_003 + prompt_uid * 8191 + j * 131 + 1) % (2 ** 31 - 1)


def longtail_budgets(run_seed: int, cap: int, median_frac: float = 0.15,
                     sigma: float = 1.0) -> Callable[[int, int], int]:
    """Per-row token budgets with a long tail, as reasoning rollouts have: lognormal with
    median ``median_frac * cap``, capped at ``cap`` (with sigma 1 about 3% of rows reach it).
    Deterministic per (run seed, prompt uid, sample index): every mode gets the same lengths."""
    mu = math.log(max(1.0, median_frac * cap))

    def budget(uid: int, j: int) -> int:
        z = random.Random(row_seed(run_seed, uid, j) ^ 0x5EED).gauss(0.0, 1.0)
        return int(min(cap, max(1, round(math.exp(mu + sigma * z)))))
    return budget


class PromptSource:
    def __init__(self, records: Iterator[dict], group_size: int, seed: int, start_uid: int = 0,
                 budget_fn: Callable[[int, int], int] | None = None):
        self.records = records
        self.group_size = group_size
        self.seed = seed
        self.budget_fn = budget_fn  # (uid, j) -> the row's max_new_tokens; None: no budget column
        self.next_uid = start_uid  # prompts issued so far: the data position saved in checkpoints

    async def __call__(self, step: int, n_prompts: int) -> dict[str, Any]:
        prompt_ids, answers, seeds, index, groups, budgets = [], [], [], [], [], []
        for _ in range(n_prompts):
            rec = next(self.records)
            uid = self.next_uid
            self.next_uid += 1
            ids = torch.as_tensor(rec["prompt_ids"], dtype=torch.long)
            for j in range(self.group_size):
                prompt_ids.append(ids)
                answers.append(str(rec["answer"]))
                seeds.append(row_seed(self.seed, uid, j))
                index.append(int(rec.get("index", uid)))
                groups.append(uid)
                if self.budget_fn is not None:
                    budgets.append(int(self.budget_fn(uid, j)))
        cols = {"prompt_ids": prompt_ids, "answer": answers, "seed": torch.tensor(seeds, dtype=torch.long),
                "prompt_index": torch.tensor(index, dtype=torch.long), "__groups__": groups}
        if self.budget_fn is not None:
            cols["max_new_tokens"] = torch.tensor(budgets, dtype=torch.long)
        return cols
