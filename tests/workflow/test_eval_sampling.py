"""The held-out evaluation over every rollout instance, and its sampled figures: the unbiased
pass@k against brute-force enumeration, the split of the prompts (each evaluated exactly once,
merged whatever order the replies come in), what is logged and put in summary.json, and the
trainer.eval_* settings' checks."""
from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.training.eval_merge import merge_evaluations, pass_at_k, pass_ks, split_prompts


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_stays_exact_for_large_n_and_refuses_bad_counts() -> None:
    # 1 - C(900, 10) / C(1000, 10), which the plain binomials would compute with ~30-digit integers
    from math import comb
    assert pass_at_k(1000, 100, 10) == pytest.approx(1 - comb(900, 10) / comb(1000, 10), rel=1e-12)
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)
    assert pass_ks(4, []) == [1, 4] and pass_ks(1, []) == [1] and pass_ks(8, [4, 2, 4]) == [2, 4]


@pytest.mark.parametrize("count,parts", [(0, 1), (1, 2), (7, 2), (16, 3), (5, 5)])
def test_split_deals_every_prompt_exactly_once(count: int, parts: int) -> None:
    shares = split_prompts(count, parts)
    assert len(shares) == parts
    assert sorted(i for s in shares for i in s) == list(range(count))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


class _Instance:
    """A rollout instance's evaluate: prompt [i] answers correctly greedy when i is even, and
    (i % 5) of its samples are correct, the others scoring 0.5; every call is recorded."""

    cls = object  # reward_totals looks for reward_stats on the groups' classes: none here

    def __init__(self, started: asyncio.Event | None = None, wait_for: asyncio.Event | None = None):
        self.calls: list[dict] = []
        self.started, self.wait_for = started, wait_for

    async def evaluate(self, prompts, answers, *, n_samples, seeds, **kwargs):
        if self.started is not None:
            self.started.set()
        if self.wait_for is not None:  # both instances run at once, or this wait times out
            await asyncio.wait_for(self.wait_for.wait(), timeout=5)
        ids = [p[0] for p in prompts]
        self.calls.append({"ids": ids, "n_samples": n_samples, "seeds": seeds, **kwargs})
        return {"accuracy": sum(i % 2 == 0 for i in ids) / len(ids), "version": 3, "reward_errors": 1,
                "reward_timeouts": 0, "examples": [{"prompt": str(i), "response": "", "answer": ""} for i in ids],
                "reward_extra": {"acc": sum(i % 2 == 0 for i in ids) / len(ids)},
                "correct": [min(i % 5, n_samples) for i in ids],  # the others score 0.5 (partial credit)
                "sample_score_sums": [min(i % 5, n_samples) + 0.5 * (n_samples - min(i % 5, n_samples)) for i in ids]}


class _Log:
    def __init__(self):
        self.rows: list[dict] = []

    def log(self, step, row):
        self.rows.append(row)


def _evaluate(instances: list, overrides: list[str], count: int = 9) -> tuple[list[dict], dict]:
    from asyncflow.training.phases import Evaluator
    from asyncflow.training.roles import RunRoles

    cfg = load_config(None, overrides)
    records = [{"prompt_ids": [i], "answer": str(i), "prompt": f"p{i}", "metadata": {}} for i in range(count)]
    logger = _Log()
    evaluate = Evaluator(cfg, RunRoles(spec=None, placement=None, groups={}, instances=instances), logger, records)

    async def both():
        await evaluate(0, "before_rl")
        await evaluate(5, "after_rl")
    asyncio.run(both())
    return logger.rows, evaluate.summary()


def test_two_instances_evaluate_their_shares_at_once_and_merge_to_the_one_instance_figures() -> None:
    sampled = ["trainer.eval_samples=4", "trainer.eval_temperature=0.7"]

    async def pair():
        a_started, b_started = asyncio.Event(), asyncio.Event()
        return [_Instance(a_started, b_started), _Instance(b_started, a_started)]
    two = asyncio.run(pair())
    rows, summary = _evaluate(two, sampled)
    one = _Instance()
    alone, alone_summary = _evaluate([one], sampled)
    first = [c for inst in two for c in inst.calls[:1]]
    assert sorted(i for c in first for i in c["ids"]) == list(range(9))  # every prompt exactly once
    assert all(c["n_samples"] == 4 and c["temperature"] == 0.7 for c in first)
    seeds = {i: s for c in first for i, s in zip(c["ids"], c["seeds"])}
    assert seeds == dict(zip(one.calls[0]["ids"], one.calls[0]["seeds"]))  # a prompt's samples: same seeds anywhere
    ordered = sorted(seeds.values())
    assert len(set(seeds.values())) == 9 and all(b - a >= 4 for a, b in zip(ordered, ordered[1:]))
    # correct samples per prompt i: i % 5 of 4 -> [0, 1, 2, 3, 4, 0, 1, 2, 3]
    want_pass1 = sum(c / 4 for c in [0, 1, 2, 3, 4, 0, 1, 2, 3]) / 9
    want_pass4 = 7 / 9
    want_mean4 = sum(c + 0.5 * (4 - c) for c in [0, 1, 2, 3, 4, 0, 1, 2, 3]) / 36  # partial credit counts
    for got in (rows[0], alone[0]):
        assert got["eval/accuracy"] == pytest.approx(5 / 9)  # prompts 0, 2, 4, 6, 8
        assert got["eval/pass@1"] == pytest.approx(want_pass1) and got["eval/pass@4"] == pytest.approx(want_pass4)
        assert got["eval/mean@4"] == pytest.approx(want_mean4)
        assert got["eval/extra/acc"] == pytest.approx(5 / 9)
    assert rows[0]["eval/reward_errors"] == 2 and alone[0]["eval/reward_errors"] == 1  # counts add up
    assert summary == alone_summary == {"eval_pass@1_before_rl": pytest.approx(want_pass1),
                                        "eval_pass@4_before_rl": pytest.approx(want_pass4),
                                        "eval_mean@4_before_rl": pytest.approx(want_mean4),
                                        "eval_pass@1_after_rl": pytest.approx(want_pass1),
                                        "eval_pass@4_after_rl": pytest.approx(want_pass4),
                                        "eval_mean@4_after_rl": pytest.approx(want_mean4)}


def test_merging_does_not_depend_on_the_order_of_the_replies() -> None:
    rng = random.Random(0)
    parts = split_prompts(11, 3)
    replies = [{"accuracy": rng.random(), "version": 2 + i, "correct": [rng.randint(0, 6) for _ in p],
                "sample_score_sums": [rng.random() * 6 for _ in p],
                "reward_extra": {"acc": rng.random()} if i else {}, "turns_mean": rng.random() * 3}
               for i, p in enumerate(parts)]
    want = merge_evaluations(parts, replies, 6, [1, 2, 6])
    order = [2, 0, 1]
    got = merge_evaluations([parts[i] for i in order], [replies[i] for i in order], 6, [1, 2, 6])
    for key in ("accuracy", "version", "pass@1", "pass@2", "pass@6", "mean@6", "turns_mean", "reward_extra"):
        assert got[key] == pytest.approx(want[key]), key
    assert want["version"] == 2  # the oldest weights evaluated
    with pytest.raises(ValueError, match="2 sample counts and 4 score sums for 4 prompts"):
        merge_evaluations([parts[0]], [{**replies[0], "correct": [1, 2]}], 6)


def test_more_instances_than_prompts_and_greedy_only() -> None:
    insts = [_Instance() for _ in range(3)]
    rows, summary = _evaluate(insts, [], count=2)
    assert [len(i.calls) for i in insts] == [2, 2, 0]  # the third has no prompt: not called
    assert rows[0]["eval/accuracy"] == pytest.approx(0.5)
    assert not any(k.startswith(("eval/pass@", "eval/mean@")) for k in rows[0]) and summary == {}
    assert all(c["n_samples"] == 0 for i in insts for c in i.calls)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.eval_samples=-1"], "trainer.eval_samples must be >= 0"),
    (["trainer.eval_samples=4", "trainer.eval_temperature=0"], "trainer.eval_temperature > 0"),
    (["trainer.eval_samples=4", "trainer.eval_k=[1,5]"], r"trainer.eval_k: \[1, 5\] must lie within 1..trainer"),
    (["trainer.eval_k=[1]"], r"trainer.eval_k: \[1\] must lie within 1..trainer.eval_samples \(0\)"),
])
def test_bad_eval_settings_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    cfg = load_config(None, ["trainer.eval_samples=8", "trainer.eval_k=[1,8]", "trainer.eval_temperature=0.6"])
    assert (cfg.trainer.eval_samples, list(cfg.trainer.eval_k), cfg.trainer.eval_temperature) == (8, [1, 8], 0.6)
