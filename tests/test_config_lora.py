"""model.lora's keys: refused at start naming the key (exit code 2), and the recipes' reference
with LoRA (the actor's model with its adapters off, no reference model)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "recipes" / "grpo" / "config.yaml"


@pytest.mark.parametrize("overrides,key", [
    (["model.lora.rank=0"], "model.lora.rank: must be >= 1"),
    (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha"),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules"),
    (["model.lora.rank=8", "model.train_engine=mindspeed"], ("model.lora.rank: LoRA is built and tested on "
                                                              "model.train_engine=fsdp only")),
])
def test_bad_lora_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GRPO, overrides)


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert load_config(GRPO).model.lora.rank is None
    lo = load_config(GRPO, ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"]).model.lora
    assert (lo.rank, lo.alpha, list(lo.target_modules)) == (8, 16.0, ["q_proj", "v_proj"])


def test_target_and_rank_the_model_cannot_take_name_the_key():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncflow.engines.train.lora import LoraOptions, lora_model_problems
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert lora_model_problems(model, LoraOptions(rank=8)) == []
    (bad,) = lora_model_problems(model, LoraOptions(rank=8, target_modules=("q_proj", "nope")))
    assert bad.startswith("model.lora.target_modules: 'nope' matches no linear layer") and "q_proj" in bad
    (wide,) = lora_model_problems(model, LoraOptions(rank=33))  # k_proj / v_proj: 64 -> 32
    assert wide.startswith("model.lora.rank: 33 exceeds the width of layer") and "= 32" in wide
    assert lora_model_problems(model, LoraOptions(rank=33, target_modules=("q_proj",))) == []
    (head,) = lora_model_problems(model, LoraOptions(rank=8, target_modules=("lm_head",)))
    assert "'lm_head' matches no linear layer" in head  # the LM head is never adapted


@pytest.mark.parametrize("args,key", [(["model.lora.rank=0"], "model.lora.rank"),
                                      (["model.lora.rank=8", "model.lora.target_modules=[nope]"],
                                       "model.lora.target_modules")])
def test_train_refuses_at_start_with_exit_code_2(tmp_path, args, key):
    p = subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", "grpo", *args, f"trainer.out_dir={tmp_path}"],
                       cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                      "HOME": str(Path.home())}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr


def test_recipes_compute_the_reference_in_the_actor_with_lora():
    from recipes.calc_tool.recipe import build as calc_build
    from recipes.grpo.recipe import build
    for make, yaml in ((build, GRPO), (calc_build, REPO / "recipes" / "calc_tool" / "config.yaml")):
        full = make(load_config(yaml, ["algorithm.kl_coef=0.01"]))
        lora = make(load_config(yaml, ["algorithm.kl_coef=0.01", "model.lora.rank=8"]))
        assert "ref" in full.roles and "ref" not in lora.roles
        (stage,) = [s for s in lora.stages if s.name == "ref_log_prob"]
        assert (stage.role, stage.method, stage.outputs) == ("actor", "compute_ref_log_probs", ["ref_log_probs"])
