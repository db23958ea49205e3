"""2-rank FSDP2 (gloo, spawned processes) against a 1-rank engine on the same global batch.

One spawn runs every 2-rank scenario (transformers' import dominates the cost); each
test checks one part of its results.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines._train_helpers import (
    BUDGETS,
    GLOBAL_N,
    RANK_SHARES,
    dist_child,
    loss_mask_batch,
    make_batch,
    ppo_loss,
    spawn_ranks,
    tiny_model,
)
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]
WORLD = 2


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fsdp2")
    return spawn_ranks(dist_child, WORLD, workdir, timeout=240)


def _one_rank_step(budget: int):
    from asyncflow.engines.train import FSDPEngine, OptimConfig

    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=budget))
    prompts, responses, fields = make_batch(GLOBAL_N, seed=1)
    metrics = engine.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    return metrics, engine.full_state_dict(), engine


@pytest.mark.parametrize("budget_name", sorted(BUDGETS))
def test_two_rank_step_equals_one_rank_step(dist_results, budget_name):
    ref_metrics, ref_state, _ = _one_rank_step(BUDGETS[budget_name])
    got = [res[budget_name] for res in dist_results]
    for r in range(WORLD):  # global metrics identical on every rank
        for key in ("loss", "grad_norm", "lr", "n_micro_batches", "tokens"):
            assert got[r]["metrics"][key] == pytest.approx(got[0]["metrics"][key], abs=1e-9), (r, key)
    metrics = got[0]["metrics"]
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
    assert metrics["tokens"] == ref_metrics["tokens"]
    assert metrics["lr"] == ref_metrics["lr"] == pytest.approx(5e-4)
    if budget_name == "tiny":  # one sequence per micro-batch: rank 0 has 5, rank 1 pads to 5
        assert metrics["n_micro_batches"] == len(RANK_SHARES[0]) and ref_metrics["n_micro_batches"] == GLOBAL_N
    else:
        assert metrics["n_micro_batches"] == 1
    state = got[0]["state"]
    assert set(state) == set(ref_state) and got[1]["state"] == {}
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= 1e-5, f"weights differ by {worst}"
    changed = max((state[k] - tiny_model(seed=0).state_dict()[k]).abs().max().item() for k in ref_state)
    assert changed > 1e-4  # the step did move the weights


def test_two_rank_log_probs_match_one_rank(dist_results):
    _, _, engine = _one_rank_step(BUDGETS["big"])
    prompts, responses, _ = make_batch(GLOBAL_N, seed=1)
    ref, _ = engine.compute_log_probs(prompts, responses)
    for r in range(WORLD):
        for i, lp in zip(RANK_SHARES[r], dist_results[r]["big"]["log_probs"]):
            assert lp.shape == responses[i].shape
            assert (lp - ref[i]).abs().max().item() <= 1e-5


def test_two_rank_loss_mask_counts_model_tokens_and_equals_one_rank(dist_results):
    """num_tokens / num_seqs count model tokens of both ranks (all-reduced), and the masked
    2-rank step is the masked 1-rank step."""
    from asyncflow.engines.train import FSDPEngine, OptimConfig

    prompts, responses, fields = loss_mask_batch()
    masks = fields["loss_mask"]
    n_tokens = sum(int(m.sum()) for m in masks)
    n_seqs = sum(1 for m in masks if int(m.sum()))
    assert n_tokens < sum(r.numel() for r in responses) and n_seqs == GLOBAL_N - 1
    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=24))
    ref = engine.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    ref_state = engine.full_state_dict()
    for r in range(WORLD):
        got = dist_results[r]["loss_mask"]
        assert got["norms"] and set(got["norms"]) == {(float(n_tokens), float(n_seqs))}, (r, got["norms"])
        assert got["metrics"]["tokens"] == n_tokens == ref["tokens"]
        assert got["metrics"]["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    state = dist_results[0]["loss_mask"]["state"]
    assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) <= 1e-5


def test_two_rank_checkpoint_resume_equals_continue(dist_results):
    for r in range(WORLD):
        c = dist_results[r]["ckpt"]
        assert c["extra"] == {"data_pos": 7} and c["b_step"] == 2
        assert c["rank_files"] == ["rank0.pt", "rank1.pt"]
        assert torch.equal(c["a_rand"], c["b_rand"]), f"rank {r}: RNG not restored"
        for key in ("loss", "grad_norm", "lr"):
            assert c["b_metrics"][key] == pytest.approx(c["a_metrics"][key], abs=1e-6), (r, key)
    a, b = dist_results[0]["ckpt"]["a_state"], dist_results[0]["ckpt"]["b_state"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_nonfinite_update_is_skipped_on_every_rank_then_stops_the_run(dist_results):
    for r in range(WORLD):
        n = dist_results[r]["nonfinite"]
        assert n["good"]["skipped_nonfinite"] == 0.0
        assert n["bad"]["skipped_nonfinite"] == 1.0, f"rank {r} did not skip the NaN step"
        assert n["step"] == 1 and n["lr_same"], "a skipped update must not advance the step or the LR schedule"
        assert n["weights_same"] and n["moments_same"], f"rank {r}: a skipped update changed the state"
        assert "2 updates in a row" in n["error"] and "optim.max_nonfinite_in_row" in n["error"], n["error"]


def test_failed_checkpoint_write_raises_everywhere_and_keeps_the_previous_one(dist_results):
    for r in range(WORLD):
        f = dist_results[r]["ckpt_fail"]
        assert "rank 1" in f["error"] and "previous checkpoint there is untouched" in f["error"], f["error"]
        assert f["same"], f"rank {r}: the previous checkpoint changed"
    # rank 0 removes the partial write before it raises (the other ranks may look earlier)
    assert not [x for x in dist_results[0]["ckpt_fail"]["leftovers"] if x.endswith(".tmp")]
