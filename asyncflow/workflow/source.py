"""The prompt source: turns dataset records into the rows of a step, n rows per prompt.

Every row carries its own sampling seed, derived from the run seed, the prompt's
position in the stream and the sample's index in its group, so a response does not
depend on how rows are batched (sync and stream see the same samples).

Besides the token ids, each row carries the prompt's text and its record's metadata (the
data file's other fields), for reward functions that want them.

An optional ``budget_fn(uid, j)`` gives each row its own token budget, written as the
``max_new_tokens`` column (benchmarks: ``rollout.length_profile=longtail``).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .. import column_names as col


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


Record = dict[str, Any]  # one prompt record of the data stream


@runtime_checkable
class _Positioned(Protocol):
    """A record stream that can jump (a PromptDataset): its length, and its place as a state dict."""

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def skip_records(records: Iterator[Record], n: int) -> Iterator[Record]:
    """The stream from its ``n``-th record on. A PromptDataset jumps there (same epoch
    order); any other iterator is advanced record by record."""
    if isinstance(records, _Positioned) and (length := len(records)):
        if records.state_dict().get("epoch", 0) == 0 and records.state_dict().get("position", 0) == 0:
            records.load_state_dict({"epoch": n // length, "position": n % length})
            return records
    for _ in range(n):
        next(records)
    return records


def resume_source(records: Iterator[Record], next_uid: int,
                  in_flight: list[int]) -> tuple[Iterator[Record], list[tuple[int, Record]]]:
    """``records`` positioned at ``next_uid``, and the (uid, record) of each in-flight prompt
    (all below next_uid), to be issued again first: nothing lost, nothing twice."""
    if any(not 0 <= u < next_uid for u in in_flight):
        raise ValueError(f"in-flight prompts {in_flight} must lie below the data position {next_uid}")
    if not in_flight:
        return skip_records(records, next_uid), []
    first = min(in_flight)
    records = skip_records(records, first)
    wanted = set(in_flight)
    replay: list[tuple[int, Record]] = []
    for uid in range(first, next_uid):
        rec = next(records)
        if uid in wanted:
            replay.append((uid, rec))
    return records, replay


class PromptSource:
    def __init__(self, records: Iterator[Record], group_size: int, seed: int, start_uid: int = 0,
                 budget_fn: Callable[[int, int], int] | None = None, replay: Sequence[tuple[int, Record]] = ()):
        self.records = records
        self.group_size = group_size
        self.seed = seed
        self.budget_fn = budget_fn  # (uid, j) -> the row's max_new_tokens; None: no budget column
        self.next_uid = start_uid  # prompts taken from the stream so far: the data position in checkpoints
        self.replay = list(replay)  # (uid, record) issued before a crash but never trained: these go first

    async def __call__(self, step: int, n_prompts: int) -> dict[str, Any]:
        prompt_ids, answers, seeds, index, groups, budgets, texts, metas = [], [], [], [], [], [], [], []
        for _ in range(n_prompts):
            if self.replay:  # same uid, so the same row seeds as before the crash
                uid, rec = self.replay.pop(0)
            else:
                rec = next(self.records)
                uid = self.next_uid
                self.next_uid += 1
            ids = torch.as_tensor(rec[col.PROMPT_IDS], dtype=torch.long)
            text, meta = str(rec.get("prompt", "")), dict(rec.get("metadata") or {})
            for j in range(self.group_size):
                prompt_ids.append(ids)
                answers.append(str(rec["answer"]))
                texts.append(text)
                metas.append(meta)
                seeds.append(row_seed(self.seed, uid, j))
                index.append(int(rec.get("index", uid)))
                groups.append(uid)
                if self.budget_fn is not None:
                    budgets.append(int(self.budget_fn(uid, j)))
        cols = {col.PROMPT_IDS: prompt_ids, col.ANSWER: answers, col.SEED: torch.tensor(seeds, dtype=torch.long),
                col.PROMPT_INDEX: torch.tensor(index, dtype=torch.long), col.PROMPT: texts, col.METADATA: metas,
                "__groups__": groups}
        if self.budget_fn is not None:
            cols[col.MAX_NEW_TOKENS] = torch.tensor(budgets, dtype=torch.long)
        return cols
