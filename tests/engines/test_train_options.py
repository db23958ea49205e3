"""The model section's engine keys (options.py): dtype policy, activation checkpointing, CPU
offload; from the config through policy_model to the engine (one rank; 2 ranks in
test_train_scale_dist.py)."""

from __future__ import annotations

import pytest
import torch

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.activation_checkpoint import checkpoint_layers
from asyncflow.engines.train.fsdp import decoder_layers
from asyncflow.engines.train.model_source import PretrainedModel
from asyncflow.engines.train.options import EngineOptions
from asyncflow.platform import get_platform
from tests.engines._train_helpers import make_batch, ppo_loss, tiny_model
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

CPU = get_platform("cpu")


def test_param_dtype_policy():
    assert EngineOptions().compute_dtype(on_accelerator=False) == torch.float32
    assert EngineOptions().compute_dtype(on_accelerator=True) == torch.bfloat16
    assert EngineOptions(param_dtype="float32").compute_dtype(on_accelerator=True) == torch.float32
    assert EngineOptions(param_dtype="bfloat16").compute_dtype(on_accelerator=False) == torch.bfloat16
    with pytest.raises(ValueError, match="model.param_dtype 'fp16'"):
        EngineOptions(param_dtype="fp16")


def test_engine_dtype_from_options_and_the_old_switch():
    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), platform=CPU)
    assert engine.compute_dtype == torch.float32 and not engine.mixed_precision
    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), platform=CPU,
                        options=EngineOptions(param_dtype="bfloat16"))
    assert engine.compute_dtype == torch.bfloat16 and engine.mixed_precision
    assert next(engine.model.parameters()).dtype == torch.float32  # master weights stay fp32
    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), platform=CPU, mixed_precision=False,
                        options=EngineOptions(param_dtype="bfloat16"))
    assert engine.compute_dtype == torch.float32


def test_config_keys_reach_the_engine_through_policy_model(tmp_path):
    from asyncflow.config import ConfigError, load_config
    from asyncflow.workers.common import policy_model

    cfg = load_config(None, ["model.path=/some/dir", "model.param_dtype=bfloat16",
                             "model.activation_checkpointing=true", "model.cpu_offload=true",
                             "model.padding_free=true"])
    source = policy_model(cfg)
    assert isinstance(source, PretrainedModel) and source.path == "/some/dir"
    assert source.options == EngineOptions(param_dtype="bfloat16", activation_checkpointing=True, cpu_offload=True,
                                           padding_free=True)
    assert policy_model(load_config(None, ["model.path=/d"])).options == EngineOptions()
    with pytest.raises(ConfigError, match="param_dtype"):
        load_config(None, ["model.param_dtype=fp16"])


def test_cpu_offload_needs_a_sharded_engine():
    with pytest.raises(ValueError, match="model.cpu_offload needs a sharded engine"):
        FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), platform=CPU,
                   options=EngineOptions(cpu_offload=True))


def test_activation_checkpointing_recomputes_each_layer_and_changes_nothing_else():
    prompts, responses, fields = make_batch(6, seed=2)
    cfg = OptimConfig(lr=1e-3, micro_batch_tokens=100_000)
    plain = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU)
    ac = FSDPEngine(lambda: tiny_model(seed=0), cfg, platform=CPU,
                    options=EngineOptions(activation_checkpointing=True))
    calls = []
    for i, layer in enumerate(decoder_layers(ac.model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.append(("mlp", i)))
    a = plain.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    b = ac.train_step(prompts, responses, fields, ppo_loss, with_entropy=True)
    assert calls.count(0) == 1 and calls.count(("mlp", 0)) == 2  # one call; its inside ran again in backward
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-7)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    sa, sb = plain.full_state_dict(), ac.full_state_dict()
    assert set(sa) == set(sb) and max((sa[k] - sb[k]).abs().max().item() for k in sa) <= 1e-7
    with pytest.raises(RuntimeError, match="already checkpointed"):
        checkpoint_layers(decoder_layers(ac.model))
