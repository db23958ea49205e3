"""LoRA (model.lora): the FSDP engine trains only the adapters, its reference is the base with
them off, weight sync sends only them, the built-in rollout engine applies them exactly, and
checkpoints and exports carry them."""
from __future__ import annotations

import types

import pytest
import torch

from tests.engines._train_helpers import make_batch, ppo_loss, tiny_model
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

pytest.importorskip("peft")

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.lora import LoraOptions, hf_name, is_adapter, merged_tensors
from asyncflow.weight_sync.shards import local_tensors

LORA = LoraOptions(rank=4, alpha=8.0)


def lora_engine(lr: float = 1e-2, opts: LoraOptions = LORA) -> FSDPEngine:
    return FSDPEngine(lambda: tiny_model(0), OptimConfig(lr=lr), lora=opts)


def trained(steps: int = 3) -> FSDPEngine:
    e = lora_engine()
    p, r, f = make_batch(8, 1)
    for _ in range(steps):
        e.train_step(p, r, f, ppo_loss)
    return e


def max_diff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


def sync_tensors(engine: FSDPEngine, mode: str = "adapters") -> list:
    """What ActorWorker.publish_weights sends of this engine."""
    from asyncflow.workers.actor import ActorWorker
    me = types.SimpleNamespace(lora=engine.lora, engine=engine, lora_sync=mode, _merged=None)
    return ActorWorker._sync_tensors(me, local_tensors(engine.model))


def test_only_adapters_train_and_reach_the_optimizer():
    e = lora_engine()
    trainable = {n for n, p in e.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    # every linear layer of the decoder (7 per layer, 2 layers), A and B each; not the LM head
    assert len(trainable) == 2 * 7 * 2
    in_optim = {id(p) for g in e.optimizer.param_groups for p in g["params"]}
    assert in_optim == {id(p) for n, p in e.model.named_parameters() if n in trainable}
    frozen = {n: p.detach().clone() for n, p in e.model.named_parameters() if not p.requires_grad}
    p, r, f = make_batch(8, 1)
    e.train_step(p, r, f, ppo_loss)
    assert all(torch.equal(p, frozen[n]) for n, p in e.model.named_parameters() if n in frozen)
    assert any(float(p.detach().abs().sum()) > 0 for n, p in e.model.named_parameters() if ".lora_B." in n)


def test_reference_is_the_base_with_adapters_off():
    e = trained()
    base = FSDPEngine(lambda: tiny_model(0), OptimConfig(lr=1e-2))
    p, r, _ = make_batch(8, 2)
    ref = e.compute_log_probs(p, r, adapters=False)[0]
    assert max_diff(ref, base.compute_log_probs(p, r)[0]) < 1e-5
    assert max_diff(e.compute_log_probs(p, r)[0], ref) > 1e-3  # the adapters do change the policy
    with pytest.raises(TypeError, match="LoRA engine"):
        base.compute_log_probs(p, r, adapters=False)


def test_merged_weights_and_fold_compute_the_policy():
    e = trained()
    p, r, _ = make_batch(8, 2)
    policy = e.compute_log_probs(p, r)[0]
    merged = dict(merged_tensors(e.model, local_tensors(e.model), LORA.scale))
    plain = tiny_model(0)
    plain.load_state_dict(merged, strict=True)
    assert max_diff(FSDPEngine(lambda: plain, OptimConfig(lr=1.0)).compute_log_probs(p, r)[0], policy) < 1e-5
    e.base_changed = False
    e.fold_adapters()  # the base becomes the policy; adapters restart from zero
    assert e.base_changed
    assert max_diff(e.compute_log_probs(p, r)[0], policy) < 1e-5
    assert max_diff(e.compute_log_probs(p, r, adapters=False)[0], policy) < 1e-5


def test_sync_sends_the_base_once_then_only_the_adapters():
    from asyncflow.weight_sync.protocol import make_header
    e = trained()
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in e.model.named_parameters() if is_adapter(n))
    first = make_header(sync_tensors(e), 1, 1, 1 << 20, 1, torch.float32)
    second = make_header(sync_tensors(e), 2, 2, 1 << 20, 1, torch.float32)
    assert second.nbytes == adapter_bytes
    assert all(s.name.endswith((".lora_A.weight", ".lora_B.weight")) for s in second.specs)
    full = sum(t.numel() * t.element_size() for t in tiny_model(0).state_dict().values())
    assert first.nbytes == full + adapter_bytes
    e.fold_adapters()  # the base changed: the next sync carries it again
    assert make_header(sync_tensors(e), 3, 3, 1 << 20, 1, torch.float32).nbytes == full + adapter_bytes
    merged = make_header(sync_tensors(e, "merged"), 4, 4, 1 << 20, 1, torch.float32)
    assert merged.nbytes == full and not any(is_adapter(s.name) for s in merged.specs)


def _rollout_engine():
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    return BuiltinRolloutEngine(tiny_model(0), eos_token_ids=[1], pad_token_id=0, lora_scale=LORA.scale)


def _greedy_matches_trainer(engine, trainer: FSDPEngine) -> None:
    from asyncflow.engines.rollout import SamplingParams
    p, _, _ = make_batch(6, 3)
    out = engine.generate(p, SamplingParams(max_new_tokens=6, temperature=1.0), seeds=list(range(len(p))))
    want = trainer.compute_log_probs(p, out.response_ids)[0]
    assert max_diff(out.log_probs, want) < 1e-4


def test_builtin_engine_after_adapter_syncs_matches_the_trainer():
    e = trained()
    engine = _rollout_engine()
    engine.load_weights(dict(sync_tensors(e)), version=1)  # the base and the adapters
    _greedy_matches_trainer(engine, e)
    p, r, f = make_batch(8, 4)
    for _ in range(2):
        e.train_step(p, r, f, ppo_loss)
    later = sync_tensors(e)  # adapters only: each version replaces the last one's exactly
    assert all(is_adapter(n) for n, _ in later)
    engine.load_weights(dict(later), version=2)
    _greedy_matches_trainer(engine, e)
    e.train_step(p, r, f, ppo_loss)
    from asyncflow.weight_sync.protocol import TensorSpec
    named = sync_tensors(e)  # through the streaming load too
    specs = [TensorSpec(n, tuple(t.shape), "float32") for n, t in named]
    engine.load_weights_stream(specs, iter(zip(specs, [t.detach() for _, t in named])), version=3)
    _greedy_matches_trainer(engine, e)


def test_builtin_engine_refuses_adapters_that_do_not_fit():
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    engine = _rollout_engine()
    layer = "model.layers.0.self_attn.q_proj"
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    with pytest.raises(KeyError, match="without its lora_B"):
        engine.load_weights({f"{layer}.lora_A.weight": a}, version=1)
    with pytest.raises(ValueError, match="do not fit"):
        engine.load_weights({f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": torch.zeros(63, 4)}, version=1)
    with pytest.raises(KeyError, match="names no linear layer"):
        engine.load_weights({"model.nope.lora_A.weight": a, "model.nope.lora_B.weight": b}, version=1)
    plain = BuiltinRolloutEngine(tiny_model(0), eos_token_ids=[1], pad_token_id=0)
    with pytest.raises(KeyError, match="without LoRA"):
        plain.load_weights({f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": b}, version=1)


def test_checkpoint_resume_restores_adapters_and_optimizer(tmp_path):
    e = trained(2)
    e.save_checkpoint(tmp_path / "ckpt")
    p, r, f = make_batch(8, 5)
    want = [e.train_step(p, r, f, ppo_loss)["loss"] for _ in range(2)]
    resumed = lora_engine()
    resumed.base_changed = False
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.base_changed and resumed.step == 2
    got = [resumed.train_step(p, r, f, ppo_loss)["loss"] for _ in range(2)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # Adam's moments came back: a fresh optimizer on the same weights takes another second step
    fresh = lora_engine()
    fresh.load_checkpoint(tmp_path / "ckpt")
    fresh.reset_optimizer(OptimConfig(lr=1e-2))
    assert [fresh.train_step(p, r, f, ppo_loss)["loss"] for _ in range(2)][1] != pytest.approx(want[1], rel=1e-6)


def test_export_writes_a_peft_adapter_and_a_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncflow.engines.train.fsdp import adapter_path
    e = trained()
    e.export_hf(tmp_path / "hf_model")
    assert adapter_path(tmp_path / "hf_model") == tmp_path / "hf_model_adapter"
    p, r, _ = make_batch(6, 6)
    policy = e.compute_log_probs(p, r)[0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.float32)
    assert max_diff(FSDPEngine(lambda: merged, OptimConfig(lr=1.0)).compute_log_probs(p, r)[0], policy) < 1e-5
    with_adapter = PeftModel.from_pretrained(tiny_model(0), tmp_path / "hf_model_adapter").merge_and_unload()
    with_adapter.requires_grad_(True)  # (PEFT leaves the merged base frozen; the engine's optimizer wants some)
    assert max_diff(FSDPEngine(lambda: with_adapter, OptimConfig(lr=1.0)).compute_log_probs(p, r)[0],
                    policy) < 1e-5


def test_hf_names():
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "model.layers.0.mlp.up_proj.lora_B.weight"
    assert hf_name("base_model.model.model.norm.weight") == "model.norm.weight"


def test_a_base_stage_trains_every_base_weight_then_rl_trains_only_the_adapters():
    """The warm-up with LoRA (ActorWorker.reset_optimizer("warmup")): the base trains, the
    adapters stay zero, each step marks the base changed (the next sync sends it); then RL
    (train_part("adapters")): only the adapters train, and the reference (adapters off) is
    the policy RL started from."""
    e = lora_engine()
    e.train_part("base")
    e.reset_optimizer(OptimConfig(lr=1e-2))
    assert {n for n, p in e.model.named_parameters() if p.requires_grad} == \
        {n for n, _ in e.model.named_parameters() if not is_adapter(n)}
    before = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    p, r, f = make_batch(8, 1)
    sync_tensors(e)  # the first sync: the base is sent, the flag cleared
    assert not e.base_changed
    e.train_step(p, r, f, ppo_loss)
    assert e.base_changed and any(not is_adapter(k) for k, _ in sync_tensors(e))  # the base goes again
    changed = {n for n, q in e.model.named_parameters() if not torch.equal(q.detach(), before[n])}
    assert changed == {n for n in before if not is_adapter(n)}

    e.train_part("adapters")
    e.reset_optimizer(OptimConfig(lr=1e-2))
    start = e.compute_log_probs(p, r)[0]
    held = {n: q.detach().clone() for n, q in e.model.named_parameters()}
    e.train_step(p, r, f, ppo_loss)
    assert not e.base_changed
    assert all(torch.equal(q.detach(), held[n]) for n, q in e.model.named_parameters() if not is_adapter(n))
    assert max_diff(e.compute_log_probs(p, r, adapters=False)[0], start) < 1e-6
    assert max_diff(e.compute_log_probs(p, r)[0], start) > 1e-4
    with pytest.raises(ValueError, match="train_part"):
        e.train_part("everything")
