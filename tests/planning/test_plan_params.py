"""Parameter counts and config.json reading, against hand computations and published sizes."""
from __future__ import annotations

import json

import pytest
from _plan_helpers import QWEN25_7B, QWEN25_32B, SMALL, SMALL_PARAMS

from asyncflow.planning import ModelShape, PlanInputError, count_params, load_config_json
from asyncflow.planning.params import tiny_model_config


def test_qwen25_7b_count_is_the_published_size():
    embedding = 152064 * 3584
    layer = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    hand = embedding + 28 * layer + 3584 + embedding  # untied lm_head
    count = count_params(ModelShape.from_config(QWEN25_7B))
    assert count.total == hand == 7_615_616_512
    assert round(count.total / 1e9, 2) == 7.62  # "7.61B" / 7.62B in Qwen's model card and report


def test_qwen25_32b_count_is_the_published_size():
    embedding = 152064 * 5120
    layer = (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120
    hand = embedding + 64 * layer + 5120 + embedding
    count = count_params(ModelShape.from_config(QWEN25_32B))
    assert count.total == hand == 32_763_876_352
    assert round(count.total / 1e9, 1) == 32.8


def test_small_config_by_hand_and_tied_embeddings_count_once():
    count = count_params(ModelShape.from_config(SMALL))
    assert (count.embedding, count.per_layer, count.final_norm, count.lm_head) == (800, 608, 8, 800)
    assert count.total == SMALL_PARAMS
    assert count.matmul == SMALL_PARAMS - 800  # the embedding lookup does no matmul
    tied = count_params(ModelShape.from_config({**SMALL, "tie_word_embeddings": True}))
    assert tied.total == SMALL_PARAMS - 800 and tied.matmul == tied.total  # the table is the output projection


def test_biases_and_norms_follow_the_architecture():
    # llama without attention_bias: no q/k/v biases (72+36+36 -> 64+32+32)
    assert count_params(ModelShape.from_config({**SMALL, "model_type": "llama"})).per_layer == 608 - 16
    llama_bias = {**SMALL, "model_type": "llama", "attention_bias": True}  # q/k/v and o biases
    assert count_params(ModelShape.from_config(llama_bias)).per_layer == 608 + 8
    # qwen3: no biases by default, q_norm and k_norm of head_dim each; head_dim may differ from hidden/heads
    qwen3 = {**SMALL, "model_type": "qwen3", "head_dim": 6}
    shape = ModelShape.from_config(qwen3)
    assert (shape.q_dim, shape.kv_dim) == (12, 6)
    # q 8*12, k 8*6, v 8*6, o 12*8, MLP 384, norms 16, q_norm + k_norm 12
    assert count_params(shape).per_layer == 96 + 48 + 48 + 96 + 384 + 16 + 12


def test_kv_heads_default_to_the_attention_heads():
    no_kv = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    assert ModelShape.from_config(no_kv).num_kv_heads == 2


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": None}, ["missing key", "hidden_size"]),
    ({"model_type": None}, ["missing key", "model_type"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers", "positive integer", "0"]),
    ({"vocab_size": "152064"}, ["vocab_size", "positive integer"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads 2", "num_key_value_heads 3"]),
    ({"model_type": "gpt2"}, ["gpt2", "qwen2, qwen3, llama, mistral"]),
    ({"num_experts": 64}, ["num_experts", "mixture-of-experts"]),
    ({"hidden_size": 9}, ["hidden_size 9", "head_dim"]),
])
def test_bad_config_names_the_key(change, words):
    cfg = {k: v for k, v in {**SMALL, **change}.items() if v is not None}
    with pytest.raises(PlanInputError) as err:
        ModelShape.from_config(cfg, "m/config.json")
    assert "m/config.json" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_config_json_from_a_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    assert load_config_json(tmp_path)[0] == SMALL
    assert load_config_json(tmp_path / "config.json") == (SMALL, str(tmp_path / "config.json"))
    with pytest.raises(PlanInputError, match="no such file"):
        load_config_json(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanInputError, match="not valid JSON"):
        load_config_json(tmp_path / "bad.json")


def test_tiny_model_is_the_built_in_shape():
    count = count_params(ModelShape.from_config(tiny_model_config()))
    # hidden 128, 2 layers, 4 heads of 32, 2 KV heads, FFN 512, 53-token vocabulary, tied
    layer = (128 * 128 + 128) + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 512 + 2 * 128
    assert count.total == 53 * 128 + 2 * layer + 128


@pytest.mark.parametrize("config, published", [
    # Qwen2.5-0.5B: tied embeddings (0.49B on its model card; 494,032,768 loaded in transformers)
    ({"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
      "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
     494_032_768),
    # Llama-3-8B: no biases, untied (8,030,261,248 loaded in transformers)
    ({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
     8_030_261_248),
])
def test_other_known_counts(config, published):
    assert count_params(ModelShape.from_config(config)).total == published


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {"head_dim": 16}),
    ("qwen3", {"attention_bias": True}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", {"head_dim": 16}),
])
def test_count_equals_transformers_on_the_meta_device(model_type, extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        model_type, num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=100, **{"tie_word_embeddings": False, **extra})
    with torch.device("meta"):  # shapes only, no memory
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once
    assert count_params(ModelShape.from_config(config.to_dict())).total == expected
