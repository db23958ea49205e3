"""Padding-free micro-batches (packing.py): the layout, the plan, and that the packed path gives
the padded path's log-probs, entropies, values and training step (one rank; the 2-rank run is in
test_train_scale_dist.py)."""

from __future__ import annotations

import pytest
import torch

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.options import EngineOptions
from asyncflow.engines.train.packing import (
    build_packed_micro_batch,
    flash_kwargs,
    packed_positions,
    plan_packed_micro_batches,
)
from asyncflow.platform import get_platform
from tests.engines._train_helpers import loss_masks_for, make_batch, ppo_loss, tiny_model, value_loss
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

CPU = get_platform("cpu")
PACKED = EngineOptions(padding_free=True)


def test_plan_respects_the_budget_and_keeps_every_sequence_once():
    lengths = [5, 9, 3, 30, 7, 7, 2, 12]
    groups = plan_packed_micro_batches(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert sum(lengths[i] for i in g) <= 16 or len(g) == 1
    assert [3] in groups  # longer than the budget: alone
    assert groups == [[3], [7, 2], [1, 4], [5, 0, 6]]  # 30 | 12+3 | 9+7 | 7+5+2: first fit, longest first
    assert plan_packed_micro_batches(lengths, 16) == groups  # deterministic
    with pytest.raises(ValueError, match="token_budget"):
        plan_packed_micro_batches(lengths, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_for_rows_keeps_the_padded_rows_within_the_budget(seed):
    """Eager/SDPA rows are padded to a common width: the plan splits a group whose rows would
    hold more positions than the budget (seen on a GPU: sequences longer than ROW_TOKENS, each
    in a row of its own padded to the longest, made micro-batches of 5,292 positions on a
    4,096-token budget, twice the padded path's peak memory)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 320, (40,), generator=g).tolist() + [5, 7, 3, 9]
    budget, row = 1024, 64
    before = plan_packed_micro_batches(lengths, budget)
    assert max(packed_positions([lengths[i] for i in grp], row) for grp in before) > budget  # the case exists
    groups = plan_packed_micro_batches(lengths, budget, row_tokens=row)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    for grp in groups:
        mb = build_packed_micro_batch([torch.zeros(1, dtype=torch.long)] * len(lengths),
                                      [torch.zeros(n - 1, dtype=torch.long) for n in lengths], grp, row_tokens=row)
        assert mb.input_ids.numel() == packed_positions([lengths[i] for i in grp], row)
        assert mb.input_ids.numel() <= budget or len(grp) == 1
    assert len(groups) < 2 * len(before) + 2  # splits, not one sequence per micro-batch
    assert plan_packed_micro_batches(lengths, budget, row_tokens=0) == before  # flash: one row, no padding


def test_packed_layout():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    responses = [torch.tensor([7, 8]), torch.tensor([9, 10, 11]), torch.tensor([12])]
    mb = build_packed_micro_batch(prompts, responses, [1, 0, 2])
    assert mb.packed and mb.attention_mask is None
    assert mb.input_ids.tolist() == [[4, 9, 10, 11, 1, 2, 3, 7, 8, 5, 6, 12]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 4, 9, 12] and mb.cu_seqlens.dtype == torch.int32 and mb.max_seqlen == 5
    assert mb.targets.tolist() == [[9, 10, 11], [7, 8, 0], [12, 0, 0]]
    assert mb.mask.tolist() == [[True] * 3, [True, True, False], [True, False, False]]
    flat = mb.input_ids[0]
    for row, n in enumerate(mb.response_lens):  # each response token is predicted by its predecessor
        assert flat[mb.logit_pos[row, :n] + 1].tolist() == mb.targets[row, :n].tolist()
    assert flash_kwargs(mb, "flash_attention_2")["cu_seq_lens_q"] is mb.cu_seqlens
    assert flash_kwargs(mb, "sdpa") == {} and flash_kwargs(mb, None) == {}


def test_packed_rows_layout():
    """Spread over rows (row_packing.pack_rows); each row's padding restarts its positions (a
    sequence of its own); logit_pos/rows find every target."""
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    responses = [torch.tensor([7, 8]), torch.tensor([9, 10, 11]), torch.tensor([12])]
    mb = build_packed_micro_batch(prompts, responses, [0, 1, 2], row_tokens=6)
    # 5 + 4 + 3 tokens, rows of at most 6: one sequence per row, padded to the longest
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0], [5, 6, 12, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert mb.rows.squeeze(1).tolist() == [0, 1, 2] and mb.cu_seqlens is None
    for i, n in enumerate(mb.response_lens):
        row = mb.input_ids[mb.rows[i, 0]]
        assert row[mb.logit_pos[i, :n] + 1].tolist() == mb.targets[i, :n].tolist() == responses[i].tolist()


@pytest.fixture(params=["row_tokens_default", "row_tokens_12"])
def row_tokens(request, monkeypatch):
    """The engine's packed rows as built (one row at these sizes), or forced to ~12 tokens (several)."""
    if request.param == "row_tokens_12":
        monkeypatch.setattr("asyncflow.engines.train.fsdp.ROW_TOKENS", 12)
        return 12
    return 0


def _model(attn: str):
    def build():
        model = tiny_model(seed=0)
        model.set_attn_implementation(attn)
        return model
    return build


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_log_probs_and_entropy_equal_padded(attn, row_tokens):
    prompts, responses, _ = make_batch(9, seed=4)
    cfg = OptimConfig(lr=1e-3, micro_batch_tokens=40)
    padded = FSDPEngine(_model(attn), cfg, platform=CPU)
    packed = FSDPEngine(_model(attn), cfg, platform=CPU, options=PACKED)
    want, want_ent = padded.compute_log_probs(prompts, responses, with_entropy=True)
    got, got_ent = packed.compute_log_probs(prompts, responses, with_entropy=True)
    if row_tokens:
        assert packed._micro_batch(prompts, responses, list(range(3))).input_ids.shape[0] > 1
    for i in range(len(prompts)):
        assert got[i].shape == responses[i].shape
        assert (got[i] - want[i]).abs().max().item() <= 1e-5, i
        assert (got_ent[i] - want_ent[i]).abs().max().item() <= 1e-5, i


def test_the_check_can_fail_attention_across_sequences_changes_log_probs():
    """Without the position ids restarting, HF sees one long sequence: the later sequences'
    log-probs change, so the equality above is not trivially true."""
    prompts, responses, _ = make_batch(3, seed=4)
    engine = FSDPEngine(_model("eager"), OptimConfig(lr=1e-3), platform=CPU, options=PACKED)
    mb = build_packed_micro_batch(prompts, responses, [0, 1, 2])
    good, _ = engine._forward(mb, 1.0, False)
    mb.position_ids = torch.arange(mb.input_ids.shape[1])[None, :]
    crossed, _ = engine._forward(mb, 1.0, False)
    assert (good[0] - crossed[0]).abs().max() < 1e-5  # the first sequence sees nothing before it
    assert (good[1:] - crossed[1:]).abs().max() > 1e-3


def test_packed_train_step_equals_padded_with_loss_masks(row_tokens):
    prompts, responses, fields = make_batch(9, seed=5)
    fields["loss_mask"] = loss_masks_for(responses, seed=5)
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=30)
    padded = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU)
    packed = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU, options=PACKED)
    a = padded.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    b = packed.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    if row_tokens:  # several rows of ~12 tokens, padded to a common width within the same 30-position budget
        assert b["n_micro_batches"] <= a["n_micro_batches"]
    else:  # one row each: packing fits more sequences per budget
        assert b["n_micro_batches"] < a["n_micro_batches"]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["tokens"] == a["tokens"]
    sa, sb = padded.full_state_dict(), packed.full_state_dict()
    # Adam's first step moves a parameter by lr * g / (|g| + eps): ~lr (5e-4 here) where the
    # gradient is clear, but where |g| is near eps the summation-order noise of g (packed vs
    # padded, and the CPU's kernels) is amplified; a real packing error moves it by ~lr.
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) <= 1e-5


def test_packed_critic_values_and_step_equal_padded():
    prompts, responses, _ = make_batch(7, seed=6)
    fields = {"returns": [torch.randn(r.shape) for r in responses]}
    cfg = OptimConfig(lr=1e-3, micro_batch_tokens=30)
    torch.manual_seed(1)
    padded = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU, value_head=True)
    torch.manual_seed(1)  # the same fresh value head
    packed = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU, value_head=True, options=PACKED)
    want, got = padded.compute_values(prompts, responses), packed.compute_values(prompts, responses)
    assert all((g - w).abs().max().item() <= 1e-5 for g, w in zip(got, want))
    a = padded.train_step(prompts, responses, fields, value_loss)
    b = packed.train_step(prompts, responses, fields, value_loss)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
