"""Single-process tests of the training engine: log-probs, schedule, clipping,
micro-batching, checkpoints, HF export, critic and the MindSpeed error."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from asyncflow.engines.train import FSDPEngine, MindSpeedEngine, OptimConfig, lr_at
from asyncflow.engines.train.microbatch import build_micro_batch, plan_micro_batches
from asyncflow.models.loading import load_causal_lm, read_causal_lm_config, record_attn_implementation
from tests.engines._train_helpers import VOCAB, make_batch, ppo_loss, tiny_model, value_loss
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse


def _engine(budget: int = 24, seed: int = 0, **optim) -> FSDPEngine:
    optim = {"lr": 1e-3, "micro_batch_tokens": budget, **optim}
    return FSDPEngine(lambda: tiny_model(seed=seed), OptimConfig(**optim))


# ------------------------------------------------------------------ micro-batching
def test_plan_respects_budget_and_covers_every_sequence():
    lengths = [5, 12, 3, 3, 9, 30, 1, 7]
    groups = plan_micro_batches(lengths, token_budget=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 16 or len(g) == 1  # an over-long sequence runs alone
        assert lengths[g[0]] == max(lengths[i] for i in g)
    assert [5] in groups  # length 30 > budget
    assert len(plan_micro_batches(lengths, token_budget=10**6)) == 1


def _padded_cost(lengths, groups, overhead):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups) + overhead * len(groups)


def _best_cost(desc, budget, overhead):
    """Brute force over every way to cut the descending lengths into runs."""
    n, best = len(desc), float("inf")
    for mask in range(1 << max(n - 1, 0)):
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        runs = list(zip(cuts, cuts[1:]))
        if all((b - a) * desc[a] <= budget or b - a == 1 for a, b in runs):
            best = min(best, sum((b - a) * desc[a] for a, b in runs) + overhead * len(runs))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_padding_aware_plan_is_the_cheapest_cut(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 40, (10,), generator=g)]
    budget, overhead = int(torch.randint(40, 200, (1,), generator=g)), int(torch.randint(0, 60, (1,), generator=g))
    groups = plan_micro_batches(lengths, budget, overhead)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    for grp in groups:
        assert len(grp) * lengths[grp[0]] <= budget or len(grp) == 1
        assert lengths[grp[0]] == max(lengths[i] for i in grp)
    assert _padded_cost(lengths, groups, overhead) == _best_cost(sorted(lengths, reverse=True), budget, overhead)


def test_padding_aware_plan_splits_a_long_tail():
    """Mostly short rows and a few long ones: one micro-batch padded to the longest would be
    mostly padding; the plan puts the long rows apart."""
    lengths = [40, 38] + [6] * 30
    assert plan_micro_batches(lengths, 8192) == [list(range(32))]  # greedy: one batch, 1280 padded
    groups = plan_micro_batches(lengths, 8192, overhead_tokens=64)
    assert groups == [[0, 1], list(range(2, 32))]  # 80 + 180 padded, + 2 x 64
    with pytest.raises(ValueError, match="overhead_tokens"):
        plan_micro_batches(lengths, 8192, overhead_tokens=-5)
    with pytest.raises(ValueError, match="micro_batch_overhead_tokens must be >= 0, or -1"):
        OptimConfig(lr=1e-3, micro_batch_overhead_tokens=-2)


def test_micro_batch_layout():
    mb = build_micro_batch([torch.tensor([1, 2]), torch.tensor([3])],
                           [torch.tensor([4, 5, 6]), torch.tensor([7])], [0, 1])
    assert mb.input_ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    assert mb.logit_pos[0].tolist() == [1, 2, 3] and mb.logit_pos[1, 0].item() == 0
    assert mb.targets.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert mb.mask.tolist() == [[True, True, True], [True, False, False]]


# ------------------------------------------------------------------ log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_full_forward(temperature):
    engine = _engine(budget=24)
    prompts, responses, _ = make_batch(9, seed=3)
    assert len(plan_micro_batches([p.numel() + r.numel() for p, r in zip(prompts, responses)], 24)) > 2
    log_probs, entropy = engine.compute_log_probs(prompts, responses, temperature=temperature, with_entropy=True)
    model = tiny_model(seed=0).eval()
    for p, r, lp, ent in zip(prompts, responses, log_probs, entropy):
        with torch.no_grad():
            logits = model(torch.cat([p, r])[None]).logits[0].float() / temperature
        full = torch.log_softmax(logits, -1)[p.numel() - 1:-1]
        assert lp.dtype == torch.float32 and lp.shape == r.shape
        assert (lp - full.gather(-1, r[:, None]).squeeze(-1)).abs().max().item() <= 1e-5
        ref_ent = -(full.exp() * full).sum(-1)
        assert (ent - ref_ent).abs().max().item() <= 1e-5


# ------------------------------------------------------------------ schedule and clipping
def test_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # 0.55
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(4, 15)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert lr_at(50, OptimConfig(lr=0.5, warmup_steps=2)) == 0.5  # total_steps 0: constant
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(warmup_steps=10, total_steps=5)


def test_engine_follows_schedule():
    engine = _engine(warmup_steps=2, total_steps=4, min_lr_ratio=0.5)
    prompts, responses, fields = make_batch(3, seed=4)
    lrs = [engine.train_step(prompts, responses, fields, ppo_loss)["lr"] for _ in range(5)]
    # warm-up 0.5, 1.0; cosine from step 2 (progress 0) to step 4 (floor 0.5)
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4])
    assert engine.step == 5


def test_grad_norm_reported_before_clipping_and_clipped():
    prompts, responses, fields = make_batch(5, seed=5)
    model = tiny_model(seed=0)
    lp_rows = []
    for p, r in zip(prompts, responses):
        logits = model(torch.cat([p, r])[None]).logits[0].float()
        lp_rows.append(torch.log_softmax(logits, -1)[p.numel() - 1:-1].gather(-1, r[:, None]).squeeze(-1))
    from asyncflow.engines.train import LossNorm
    from asyncflow.engines.train.microbatch import pad_right
    width = max(r.numel() for r in responses)
    mask = pad_right([torch.ones_like(r, dtype=torch.bool) for r in responses], width, False)
    padded = {k: (v if isinstance(v, torch.Tensor) else pad_right(v, width)) for k, v in fields.items()}
    norm = LossNorm(float(mask.sum()), float(len(responses)))
    loss, _ = ppo_loss(pad_right(lp_rows, width), None, mask, padded, norm)
    loss.backward()
    ref_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item()

    clip = ref_norm / 4
    engine = _engine(budget=16, grad_clip=clip)
    metrics = engine.train_step(prompts, responses, fields, ppo_loss)
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    after = torch.sqrt(sum((p.grad ** 2).sum() for p in engine.model.parameters() if p.grad is not None)).item()
    assert after == pytest.approx(clip, rel=1e-4)


def test_the_weights_change_hook_runs_before_every_write_of_the_parameters(tmp_path):
    """A weight sync may leave messages that read the parameters on the wire past its return:
    the engine calls ``before_weights_change`` before the optimizer step and before loading
    weights, while the parameters still hold what was sent."""
    engine = _engine()
    assert engine.guards_weight_writes
    seen: list[dict] = []
    engine.before_weights_change = lambda: seen.append({k: v.clone() for k, v in engine.full_state_dict().items()})
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    prompts, responses, fields = make_batch(3, seed=4)
    engine.train_step(prompts, responses, fields, ppo_loss)
    assert len(seen) == 1 and all(torch.equal(seen[0][k], before[k]) for k in before)
    after = engine.full_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the step did write them
    engine.load_model_state(before)
    assert len(seen) == 2 and all(torch.equal(seen[1][k], after[k]) for k in after)
    engine.save_checkpoint(tmp_path / "c")
    engine.load_checkpoint(tmp_path / "c")
    assert len(seen) == 3


def test_bad_fields_raise_with_key():
    engine = _engine()
    prompts, responses, fields = make_batch(3, seed=6)
    fields["advantages"][1] = torch.zeros(responses[1].numel() + 1)
    with pytest.raises(ValueError, match="'advantages', sequence 1"):
        engine.train_step(prompts, responses, fields, ppo_loss)


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_resume_equals_continue(tmp_path):
    p1, r1, f1 = make_batch(6, seed=7)
    p2, r2, f2 = make_batch(6, seed=8)
    a = _engine(warmup_steps=3)
    a.train_step(p1, r1, f1, ppo_loss)
    a.save_checkpoint(tmp_path / "ck", extra={"data_pos": 42})
    a_rand = torch.rand(4)
    a_metrics = a.train_step(p2, r2, f2, ppo_loss)
    a_state = a.full_state_dict()

    b = _engine(seed=9, warmup_steps=3)
    torch.manual_seed(77)
    assert b.load_checkpoint(tmp_path / "ck") == {"data_pos": 42}
    assert b.step == 1
    assert torch.equal(torch.rand(4), a_rand)
    b_metrics = b.train_step(p2, r2, f2, ppo_loss)
    for key in ("loss", "grad_norm", "lr"):
        assert b_metrics[key] == pytest.approx(a_metrics[key], abs=1e-6), key
    b_state = b.full_state_dict()
    assert max((a_state[k] - b_state[k]).abs().max().item() for k in a_state) <= 1e-6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_checkpoint_failure_leaves_previous_untouched(tmp_path):
    engine = _engine()
    engine.save_checkpoint(tmp_path / "ck", extra={"v": 1})
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    prompts, responses, fields = make_batch(3, seed=10)
    engine.train_step(prompts, responses, fields, ppo_loss)
    with pytest.raises(RuntimeError, match=r"save_checkpoint.*failed.*rank 0"):
        engine.save_checkpoint(tmp_path / "ck", extra={"unpicklable": lambda: 0})
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dir left
    assert _engine().load_checkpoint(tmp_path / "ck") == {"v": 1}

    engine.save_checkpoint(tmp_path / "ck", extra={"v": 2})  # overwrite works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert _engine().load_checkpoint(tmp_path / "ck") == {"v": 2}

    (tmp_path / "file").write_text("x")
    with pytest.raises(RuntimeError, match="cannot create temp dir"):
        engine.save_checkpoint(tmp_path / "file" / "ck")
    with pytest.raises(RuntimeError, match="meta.pt is missing"):
        engine.load_checkpoint(tmp_path / "nowhere")


# ------------------------------------------------------------------ HF export
def test_export_hf_loads_with_auto_model_and_same_logits(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    engine = _engine()
    prompts, responses, fields = make_batch(4, seed=11)
    engine.train_step(prompts, responses, fields, ppo_loss)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    engine.export_hf(tmp_path / "hf", tokenizer=tokenizer)
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 10))
    engine.model.eval()
    with torch.no_grad():
        diff = (loaded(ids).logits - engine.model(ids).logits).abs().max().item()
    assert diff <= 1e-6
    # The export loads back with the kernel it trained with (config.json does not record it).
    assert load_causal_lm(tmp_path / "hf").config._attn_implementation == "eager"
    assert read_causal_lm_config(tmp_path / "hf")._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="exists"):
        engine.export_hf(tmp_path / "hf")


def test_full_state_dict_has_hf_names_and_is_a_copy():
    engine = _engine()
    state = engine.full_state_dict()
    assert set(state) == set(tiny_model().state_dict())
    state["model.norm.weight"].add_(1.0)
    assert not torch.equal(state["model.norm.weight"], engine.model.model.norm.weight)


# ------------------------------------------------------------------ critic
def test_critic_values_shapes_and_regression_trains():
    critic = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=3e-3, micro_batch_tokens=24), value_head=True)
    prompts, responses, _ = make_batch(6, seed=12)
    values = critic.compute_values(prompts, responses)
    assert [v.shape for v in values] == [r.shape for r in responses]
    assert all(v.dtype == torch.float32 for v in values)
    returns = [torch.full(r.shape, 0.5) + 0.1 * torch.arange(r.numel()) for r in responses]
    losses = [critic.train_step(prompts, responses, {"returns": returns}, value_loss)["loss"] for _ in range(25)]
    assert losses[-1] < 0.2 * losses[0], losses
    assert "value_head.weight" in critic.full_state_dict()
    with pytest.raises(TypeError, match="compute_values"):
        critic.compute_log_probs(prompts, responses)
    with pytest.raises(TypeError, match="value_head=True"):
        _engine().compute_values(prompts, responses)


# ------------------------------------------------------------------ MindSpeed
def test_mindspeed_missing_gives_clear_error(monkeypatch):
    factory = lambda: tiny_model()  # noqa: E731 - never called
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(ImportError, match=r"'torch_npu'.*pip install asyncflow\[npu\]"):
        MindSpeedEngine(factory, OptimConfig())
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "mindspeed", None)
    with pytest.raises(ImportError, match=r"'mindspeed'.*pip install asyncflow\[npu\]"):
        MindSpeedEngine(factory, OptimConfig())


def test_only_portable_attention_kernels_are_recorded(tmp_path):
    from asyncflow.models.loading import _default_attn_implementation
    for kernel, expected in (("sdpa", "sdpa"), ("flash_attention_2", None), (None, None)):
        d = tmp_path / str(kernel)
        d.mkdir()
        record_attn_implementation(d, kernel)
        assert _default_attn_implementation(d) == expected
