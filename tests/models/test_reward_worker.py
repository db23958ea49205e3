"""The rule-based reward worker on the built-in tiny model's tokenizer: a response is read up to
its first EOS (with rollout.ignore_eos a row runs on past it)."""
from __future__ import annotations

import pytest
import torch


def test_reward_reads_a_response_up_to_its_first_eos(tiny_dir):
    from asyncflow.config import load_config, to_dict
    from asyncflow.models import load_tokenizer
    from asyncflow.workers.reward import RewardWorker

    cfg = load_config(None, [f"model.path={tiny_dir}"])
    worker = RewardWorker(to_dict(cfg))
    tok = load_tokenizer(tiny_dir)
    eos = tok.eos_token_id
    answer = tok.encode("42", add_special_tokens=False)
    tail = tok.encode("17", add_special_tokens=False)
    responses = [torch.tensor(answer + [eos]),            # stopped at EOS
                 torch.tensor(answer + [eos] + tail + [eos]),  # ran on past it: the tail is not read
                 torch.tensor(answer + tail)]              # no EOS: all of it
    out = worker.compute({"response_ids": responses, "answer": ["42", "42", "42"]})
    assert out["scores"].tolist() == [1.0, 1.0, 0.0]


def test_eos_ids_come_from_the_tokenizer_and_the_generation_config(tiny_dir, tmp_path):
    import json
    import shutil

    from asyncflow.models import ModelLoadError, load_tokenizer
    from asyncflow.models.loading import eos_token_ids

    tok = load_tokenizer(tiny_dir)
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 5]}))
    assert eos_token_ids(d, tok) == [tok.eos_token_id, 5]  # an instruct model's second end-of-turn id
    (d / "generation_config.json").unlink()
    assert eos_token_ids(d, tok) == [tok.eos_token_id]
    (d / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        eos_token_ids(d, tok)
