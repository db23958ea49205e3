"""The rule-based reward worker on the built-in tiny model's tokenizer: a response is read up to
its first EOS (with rollout.ignore_eos a row runs on past it)."""
from __future__ import annotations

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
