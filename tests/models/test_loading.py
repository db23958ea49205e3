"""load_causal_lm / load_tokenizer: our directory loads; each broken directory gives a clear error."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from asyncflow.models import ModelLoadError, load_causal_lm, load_tokenizer


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in skip:
            shutil.copy(p, dst / p.name)
    return dst


def test_loads_tiny_model_and_tokenizer(tiny_dir):
    model = load_causal_lm(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    assert model.config._attn_implementation == "eager"  # from asyncflow_spec.json
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token_id == 0 and len(tok) == model.config.vocab_size
    model16 = load_causal_lm(tiny_dir, dtype="bfloat16", attn_implementation="sdpa")
    assert next(model16.parameters()).dtype == torch.bfloat16
    assert model16.config._attn_implementation == "sdpa"


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*never downloads"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_causal_lm(f)


def test_no_config(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m", skip=("config.json",))
    with pytest.raises(ModelLoadError, match=r"no config.json in .*m.*model.safetensors"):
        load_causal_lm(d)


def test_config_not_json(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_causal_lm(d)


def test_unsupported_architecture(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as info:
        load_causal_lm(d)
    msg = str(info.value)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg
    for name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert name in msg


def test_no_weights(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="no weights file in .*model.safetensors"):
        load_causal_lm(d)


def test_corrupt_weights_name_the_directory(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=r"transformers could not load .*m"):
        load_causal_lm(d)


def test_bad_dtype(tiny_dir):
    with pytest.raises(ModelLoadError, match="not a torch dtype"):
        load_causal_lm(tiny_dir, dtype="float33")


def test_tokenizer_larger_than_embedding(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 20
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"tokenizer mismatch.*53 tokens.*only 20 rows"):
        load_tokenizer(d)


def test_no_tokenizer_files(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m", skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(d)


def test_missing_pad_is_set_to_eos_and_logged(tmp_path, tiny_dir, caplog):
    d = _copy(tiny_dir, tmp_path / "m", skip=("config.json",))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token")
    cfg_path.write_text(json.dumps(cfg))
    tok_json = json.loads((d / "tokenizer.json").read_text())
    tok_json["added_tokens"] = [t for t in tok_json["added_tokens"] if t["content"] != "<pad>"]
    (d / "tokenizer.json").write_text(json.dumps(tok_json))
    with caplog.at_level(logging.INFO, logger="asyncflow.models.loading"):
        tok = load_tokenizer(d)
    assert tok.pad_token == "<eos>" and tok.pad_token_id == tok.eos_token_id
    assert any("no pad token" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("broken, match", [
    ("missing", "does not exist"), ("no_config", "no config.json"), ("gpt2", "unsupported architecture"),
    ("no_weights", "no weights file"), ("no_tokenizer", "no tokenizer files")])
def test_check_model_dir_refuses_from_the_files_what_loading_refuses(tmp_path, tiny_dir, broken, match):
    """The launcher's check before any rank starts: each broken directory is named and refused
    by the file checks alone, with the message loading would give."""
    from asyncflow.models.loading import check_model_dir
    check_model_dir(tiny_dir)  # ours passes
    skip = {"no_config": ("config.json",), "no_weights": ("model.safetensors",),
            "no_tokenizer": ("tokenizer.json", "tokenizer_config.json")}.get(broken, ())
    d = tmp_path / "nope" if broken == "missing" else _copy(tiny_dir, tmp_path / "m", skip=skip)
    if broken == "gpt2":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=match):
        check_model_dir(d)
    if broken != "no_tokenizer":  # (a tokenizer is load_tokenizer's to refuse)
        with pytest.raises(ModelLoadError, match=match):
            load_causal_lm(d)


def test_check_model_dir_as_a_reward_model_wants_one_label_of_sequence_classification(tiny_dir):
    from asyncflow.models.loading import check_model_dir
    with pytest.raises(ModelLoadError, match="ForSequenceClassification"):
        check_model_dir(tiny_dir, reward_model=True)  # a causal LM is not a reward model
