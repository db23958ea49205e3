"""LoRA on 2-rank FSDP2 (gloo, spawned processes): each rank merges its own rows of every
adapted weight (the A matrices gathered) and folds them in place; the merged weights and the
folded base must be what one rank computes from the whole tensors, and what one rank trained
on the same global batch holds."""
from __future__ import annotations

import pytest

from tests.engines._lora_dist_helpers import GLOBAL_N, LORA_ALPHA, LORA_RANK, lora_dist_child, lora_engine, train, whole
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse
from tests.engines._train_helpers import spawn_ranks

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow]
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(lora_dist_child, WORLD, tmp_path_factory.mktemp("lora2"), timeout=300)


@pytest.fixture(scope="module")
def one_rank():
    from asyncflow.engines.train.lora import merged_tensors
    from asyncflow.weight_sync.shards import local_tensors

    engine = lora_engine()
    train(engine, list(range(GLOBAL_N)))
    merged = whole(merged_tensors(engine.model, local_tensors(engine.model), engine.lora.scale))
    return engine, merged


def _worst(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sharded_merge_equals_the_merge_of_the_whole_tensors(ranks):
    from asyncflow.engines.train.lora import merge_state_dict
    r0, r1 = ranks
    assert r0["sharded"] and r0["sharded"] == r1["sharded"]  # the adapted weights were merged shard by shard
    assert _worst(r0["merged"], r1["merged"]) == 0.0  # every rank gathers the same whole tensors
    from_whole = merge_state_dict(r0["state"], LORA_ALPHA / LORA_RANK)
    assert _worst(r0["merged"], from_whole) < 1e-6
    b = {k: v for k, v in r0["state"].items() if ".lora_B." in k}
    assert b and max(float(v.abs().max()) for v in b.values()) > 1e-4  # training moved the adapters


def test_two_rank_merge_equals_one_rank_merge(ranks, one_rank):
    _, merged = one_rank
    assert _worst(ranks[0]["merged"], merged) < 1e-5


def test_fold_across_ranks_is_the_merged_model_with_fresh_adapters(ranks):
    from asyncflow.engines.train.lora import hf_name
    r0 = ranks[0]
    assert r0["folded_layers"] == ranks[1]["folded_layers"] == 2 * 7  # 7 linear layers in each of 2 layers
    folded = r0["folded_state"]
    base = {hf_name(k): v for k, v in folded.items() if ".lora_" not in k}
    assert _worst(base, r0["merged"]) < 1e-6
    assert all(float(v.abs().max()) == 0.0 for k, v in folded.items() if ".lora_B." in k)
    for r in ranks:  # the policy did not change; its base is now the policy
        assert max(float((x - y).abs().max()) for x, y in zip(r["folded_log_probs"], r["log_probs"])) < 1e-5
        assert max(float((x - y).abs().max()) for x, y in zip(r["folded_base_log_probs"], r["log_probs"])) < 1e-5


def test_two_rank_fold_equals_one_rank_fold(ranks, one_rank):
    from asyncflow.engines.train.lora import hf_name
    engine, _ = one_rank
    engine.fold_adapters()
    want = {hf_name(k): v for k, v in engine.full_state_dict().items() if ".lora_A." not in k}
    got = {hf_name(k): v for k, v in ranks[0]["folded_state"].items() if ".lora_A." not in k}
    # the folded bases and the zeroed B (the A matrices, which the fold leaves alone, are
    # training's: 2-rank and 1-rank Adam steps at lr 1e-2 part in their rounding)
    assert _worst(got, want) < 1e-5
