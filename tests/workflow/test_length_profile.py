"""rollout.length_profile=longtail: per-row token budgets written by the prompt source."""
from __future__ import annotations

import asyncio
import statistics

import pytest
import torch

from asyncflow.config import ConfigError, load_config
from asyncflow.workflow.source import PromptSource, longtail_budgets


def _records():
    i = 0
    while True:
        yield {"prompt_ids": [1, 2, 3], "answer": str(i), "index": i}
        i += 1


def test_budgets_are_deterministic_per_seed_uid_and_sample():
    a, b = longtail_budgets(0, 64), longtail_budgets(0, 64)
    assert [a(u, j) for u in range(50) for j in range(4)] == [b(u, j) for u in range(50) for j in range(4)]
    other = longtail_budgets(1, 64)
    assert [a(u, j) for u in range(50) for j in range(4)] != [other(u, j) for u in range(50) for j in range(4)]
    assert a(3, 1) != a(3, 2) or a(3, 1) != a(4, 1)  # rows of a group differ


def test_budgets_have_a_long_tail_capped_at_max_new_tokens():
    cap = 64
    fn = longtail_budgets(0, cap)
    xs = [fn(u, j) for u in range(500) for j in range(8)]
    assert min(xs) >= 1 and max(xs) == cap
    assert statistics.median(xs) <= cap / 4  # most rows short
    at_cap = sum(x == cap for x in xs) / len(xs)
    assert 0.005 < at_cap < 0.1  # a few rows run to the limit


def test_source_writes_the_budget_column_only_with_a_budget_fn():
    fn = longtail_budgets(7, 32)
    cols = asyncio.run(PromptSource(_records(), 4, 7, budget_fn=fn)(0, 3))
    b = cols["max_new_tokens"]
    assert b.dtype == torch.int64 and b.tolist() == [fn(u, j) for u in range(3) for j in range(4)]
    again = asyncio.run(PromptSource(_records(), 4, 7, budget_fn=fn)(0, 3))
    assert again["max_new_tokens"].tolist() == b.tolist()
    plain = asyncio.run(PromptSource(_records(), 4, 7)(0, 3))
    assert "max_new_tokens" not in plain


def test_config_key_is_checked_and_the_recipe_reads_the_column():
    from asyncflow.workflow.recipe import find_recipe
    with pytest.raises(ConfigError, match="rollout.length_profile"):
        load_config(overrides=["rollout.length_profile=bogus"])
    grpo = find_recipe("grpo")
    from asyncflow.training.trainer import source_columns
    on_cfg, off_cfg = load_config(overrides=["rollout.length_profile=longtail"]), load_config()
    on = grpo.build(on_cfg, source_columns(on_cfg)).stages
    off = grpo.build(off_cfg, source_columns(off_cfg)).stages
    assert "max_new_tokens" in on[0].inputs and "max_new_tokens" not in off[0].inputs
