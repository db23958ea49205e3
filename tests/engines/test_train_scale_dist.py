"""2-rank FSDP2 (gloo, spawned processes) of the scale options: each rank loads only its rows of
a safetensors checkpoint (built on meta, nothing broadcast but buffers), tied weights stay tied;
padding-free + activation checkpointing and CPU offload give the 1-rank padded step; a reward
model from a plain loader (built on meta on rank 1) scores as on one rank."""

from __future__ import annotations

import pytest
import torch

from tests.engines._scale_helpers import SCALE_BUDGET, save_reward_model, scale_child
from tests.engines._train_helpers import RANK_SHARES, loss_mask_batch, ppo_loss, spawn_ranks, tiny_model
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("scale")
    tiny_model(seed=3).save_pretrained(workdir / "ckpt", max_shard_size="20KB")  # several files + an index
    broken = tiny_model(seed=3)
    broken.model.norm.weight = None  # saved without it
    broken.save_pretrained(workdir / "broken")
    save_reward_model(workdir / "rm")
    return workdir, spawn_ranks(scale_child, WORLD, workdir, timeout=300)


def test_each_rank_holds_only_its_rows_of_the_checkpoint(results):
    workdir, res = results
    from asyncflow.models.loading import SafetensorsWeights, load_causal_lm

    with SafetensorsWeights(workdir / "ckpt") as ckpt:
        for r in range(WORLD):
            got = res[r]["pretrained"]
            assert got["tied"], f"rank {r}: lm_head no longer shares the embedding"
            # every parameter read by the rank itself; only the rotary buffers (not stored) are sent
            assert len(got["buffers"]) == 2, got["buffers"].keys()
            assert got["counts"] == {"read": len(got["shards"]), "broadcast": 2}, got["counts"]
            assert "lm_head.weight" not in ckpt.names()  # tied: only the embedding is stored
            for name, (rows, local) in got["shards"].items():
                full = ckpt.read(name)
                assert rows is not None and local.shape[0] == rows[1] - rows[0] < full.shape[0] or full.shape[0] == 1
                assert torch.equal(local, full[rows[0]:rows[1]]), (r, name)
            ref = load_causal_lm(workdir / "ckpt")
            for name, buf in ref.named_buffers():
                assert torch.equal(got["buffers"][name], buf), (r, name)
    state = res[0]["pretrained"]["state"]
    want = tiny_model(seed=3).state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)


def test_a_tensor_missing_from_the_checkpoint_fails_on_every_rank(results):
    workdir, res = results
    assert "'model.norm.weight'" in res[0]["broken"] and str(workdir / "broken") in res[0]["broken"], res[0]["broken"]
    broken = res[1]["broken"]
    assert "rank 1" in broken and "first rank found no weights for 1 tensors" in broken, broken


def _one_rank_padded():
    from asyncflow.engines.train import FSDPEngine, OptimConfig

    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, warmup_steps=2,
                                                                micro_batch_tokens=SCALE_BUDGET))
    prompts, responses, fields = loss_mask_batch()
    metrics = engine.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    log_probs, _ = engine.compute_log_probs(prompts, responses)
    return metrics, engine.full_state_dict(), log_probs


@pytest.mark.parametrize("scenario", ["packed_ac", "offload"])
def test_two_rank_options_equal_one_rank_padded_step(results, scenario):
    _, res = results
    ref_metrics, ref_state, ref_lp = _one_rank_padded()
    for r in range(WORLD):
        got = res[r][scenario]
        assert got["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5), r
        assert got["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5), r
        assert got["metrics"]["tokens"] == ref_metrics["tokens"]
        for i, lp in zip(RANK_SHARES[r], got["log_probs"]):
            assert (lp - ref_lp[i]).abs().max().item() <= 1e-5, (r, i)
        assert got["param_devices"] == ["cpu"]
    state = res[0][scenario]["state"]
    assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) <= 1e-5
    if scenario == "packed_ac":  # packing fits more per budget: fewer micro-batches than padded
        assert res[0][scenario]["metrics"]["n_micro_batches"] < ref_metrics["n_micro_batches"]


def test_reward_model_from_a_loader_scores_as_on_one_rank(results):
    workdir, res = results
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.models.loading import load_reward_model

    one = FSDPEngine(lambda: load_reward_model(workdir / "rm"), OptimConfig(lr=1.0), value_head=True)
    prompts, responses, _ = loss_mask_batch()
    want = one.compute_values(prompts, responses)
    for r in range(WORLD):
        for i, v in zip(RANK_SHARES[r], res[r]["reward"]["values"]):
            assert (v - want[i]).abs().max().item() <= 1e-5, (r, i)
    ref = one.full_state_dict()
    state = res[0]["reward"]["state"]
    assert all(torch.equal(state[k], ref[k]) for k in ref)
