"""A reward model served by the training engine scores a sequence as the checkpoint's own
sequence-classification head does; wrong checkpoints get clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.models.loading import ModelLoadError, load_reward_model
from asyncflow.platform import get_platform
from asyncflow.workers.reward_model import score_sequences


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=53, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                      attn_implementation="eager")
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_()
    d = tmp_path_factory.mktemp("rm")
    model.save_pretrained(d)
    return d, model.eval()


def test_engine_scores_equal_the_classifier(rm_dir):
    torch.set_num_threads(1)
    d, hf = rm_dir
    engine = FSDPEngine(lambda: load_reward_model(d), OptimConfig(lr=1.0, micro_batch_tokens=32),
                        platform=get_platform("cpu"), mixed_precision=False, value_head=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 53, (n,), generator=g) for n in (3, 5, 7, 4)]
    responses = [torch.randint(3, 53, (n,), generator=g) for n in (2, 6, 1, 4)]
    got = score_sequences(engine, prompts, responses, pad_id=0)
    with torch.no_grad():
        want = [float(hf(torch.cat([p, r])[None]).logits[0, 0]) for p, r in zip(prompts, responses)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    assert len({round(x, 4) for x in got}) > 1  # the scores differ: the check can fail


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model
    d = build_tiny_model(tmp_path / "lm", TinyModelSpec(hidden_size=64, intermediate_size=128))
    with pytest.raises(ModelLoadError, match="ForSequenceClassification"):
        load_reward_model(d)


def test_more_than_one_label_is_refused(tmp_path, rm_dir):
    d, _ = rm_dir
    bad = tmp_path / "two"
    bad.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    cfg.pop("num_labels", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="2 labels|labels"):
        load_reward_model(bad)
