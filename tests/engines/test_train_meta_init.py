"""Building on the meta device and loading (one rank): the engine's weights are the checkpoint's,
tied weights stay tied, what a checkpoint lacks or gets wrong fails with the key and the place.
The 2-rank (sharded) side is in test_train_scale_dist.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.meta_init import parameters_on_meta, shard_rows, tensor_names
from asyncflow.engines.train.model_source import FactorySource, PretrainedModel, as_model_source
from asyncflow.models.loading import ModelLoadError, SafetensorsWeights, load_causal_lm
from asyncflow.platform import get_platform
from tests.engines._train_helpers import make_batch, ppo_loss, tiny_model
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

CPU = get_platform("cpu")


def save_tiny(path, tie: bool = True, shard: str | None = None):
    """A tiny Qwen2 checkpoint (random weights, seed 3) in ``path``; ``shard`` splits it into
    several safetensors files with an index."""
    model = tiny_model(seed=3, tie=tie)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tied"))


def test_parameters_on_meta_keeps_buffers_and_ties_and_restores_torch():
    register = nn.Module.register_parameter
    with parameters_on_meta():
        model = tiny_model(seed=0)
    assert nn.Module.register_parameter is register
    assert {p.device.type for p in model.parameters()} == {"meta"}
    buffers = dict(model.named_buffers())
    assert buffers and {b.device.type for b in buffers.values()} == {"cpu"}
    want = dict(tiny_model(seed=0).named_buffers())["model.rotary_emb.inv_freq"]
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], want)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tensor_names(model)["model.embed_tokens.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]
    real = nn.Linear(2, 2)  # outside the context: real again
    assert real.weight.device.type == "cpu"
    with parameters_on_meta():  # nested: the inner one restores the outer's patch
        with parameters_on_meta():
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
    assert inner.weight.is_meta and outer.weight.is_meta and nn.Module.register_parameter is register


def test_shard_rows_of_a_plain_tensor_is_everything():
    assert shard_rows(torch.zeros(3, 2)) is None


def test_safetensors_rows_and_index(tmp_path):
    one = save_tiny(tmp_path / "one")
    many = save_tiny(tmp_path / "many", shard="20KB")
    assert (many / "model.safetensors.index.json").is_file() and len(list(many.glob("*.safetensors"))) > 2
    ref = tiny_model(seed=3).state_dict()
    for d in (one, many):
        with SafetensorsWeights(d) as w:
            assert "model.layers.1.mlp.up_proj.weight" in w.names()
            full = w.read("model.layers.1.mlp.up_proj.weight")
            assert torch.equal(full, ref["model.layers.1.mlp.up_proj.weight"])
            assert torch.equal(w.read("model.layers.1.mlp.up_proj.weight", (5, 9)), full[5:9])
            assert w.shape("model.norm.weight") == [64]


def test_pretrained_engine_holds_the_checkpoint_and_ties(tied_dir):
    engine = FSDPEngine(PretrainedModel(str(tied_dir)), OptimConfig(lr=1e-3), platform=CPU)
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert engine.optimizer.param_groups[0]["params"][0] is model.model.embed_tokens.weight
    ref = load_causal_lm(tied_dir)
    got = engine.full_state_dict()
    want = ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for name, buf in ref.named_buffers():  # rotary buffers (not in the checkpoint) too
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    prompts, responses, fields = make_batch(4, seed=1)
    lp, _ = engine.compute_log_probs(prompts, responses)
    ref_engine = FSDPEngine(lambda: load_causal_lm(tied_dir), OptimConfig(lr=1e-3), platform=CPU)
    want_lp, _ = ref_engine.compute_log_probs(prompts, responses)
    assert all(torch.equal(a, b) for a, b in zip(lp, want_lp))
    # A step moves the tied weight once, as the plain model's engine does.
    a = engine.train_step(prompts, responses, fields, ppo_loss)
    b = ref_engine.train_step(prompts, responses, fields, ppo_loss)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_and_sharded_checkpoint_loads_lm_head(tmp_path):
    d = save_tiny(tmp_path / "untied", tie=False, shard="20KB")
    engine = FSDPEngine(PretrainedModel(str(d)), OptimConfig(lr=1e-3), platform=CPU)
    assert engine.model.lm_head.weight is not engine.model.model.embed_tokens.weight
    want = tiny_model(seed=3, tie=False).state_dict()
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_critic_from_pretrained_keeps_backbone_and_gets_a_head(tied_dir):
    engine = FSDPEngine(PretrainedModel(str(tied_dir)), OptimConfig(lr=1e-3), platform=CPU, value_head=True)
    want = tiny_model(seed=3).state_dict()
    got = engine.full_state_dict()
    assert {k for k in got if k.startswith("value_head")} == {"value_head.weight", "value_head.bias"}
    for k, v in got.items():
        if k.startswith("backbone."):
            assert torch.equal(v, want["model." + k[len("backbone."):]]), k
    assert got["value_head.weight"].abs().sum() > 0  # initialised, not left empty


def test_factory_weights_are_the_factory_s():
    engine = FSDPEngine(lambda: tiny_model(seed=7), OptimConfig(lr=1e-3), platform=CPU)
    want = tiny_model(seed=7).state_dict()
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def test_factory_builds_on_meta_except_on_the_first_rank():
    source = as_model_source(lambda: tiny_model(seed=0))
    assert isinstance(source, FactorySource)
    assert {p.device.type for p in source.build(rank=1).parameters()} == {"meta"}
    assert {p.device.type for p in source.build(rank=0).parameters()} == {"cpu"}
    with pytest.raises(TypeError, match="ModelSource"):
        as_model_source("not a model")


def _rewrite_without(src, dst, drop: str | None = None, reshape: str | None = None):
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_missing_tensor_names_the_key_and_the_directory(tied_dir, tmp_path):
    d = _rewrite_without(tied_dir, tmp_path / "missing", drop="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.up_proj\.weight") as err:
        FSDPEngine(PretrainedModel(str(d)), OptimConfig(lr=1e-3), platform=CPU)
    assert str(d) in str(err.value) and "rank 0" in str(err.value)


def test_a_wrong_shape_names_the_key(tied_dir, tmp_path):
    d = _rewrite_without(tied_dir, tmp_path / "shape", reshape="model.norm.weight")
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[63\].*config\.json"):
        FSDPEngine(PretrainedModel(str(d)), OptimConfig(lr=1e-3), platform=CPU)


def test_bin_only_directory_is_refused_with_the_fix(tied_dir, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    cfg = json.loads((tied_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save(tiny_model(seed=3).state_dict(), d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safe_serialization=True"):
        FSDPEngine(PretrainedModel(str(d)), OptimConfig(lr=1e-3), platform=CPU)
