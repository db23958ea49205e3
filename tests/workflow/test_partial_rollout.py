"""Partial rollout in the rollout worker: a generation that meets newer weights stops,
swaps them in and continues the same rows; every token keeps the version that made it."""
from __future__ import annotations

import pytest
import torch

from asyncflow.workflow import weight_sync as ws


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, intermediate_size=128))


def _worker(model_dir, partial: bool):
    """A RolloutWorker built without the runtime (its __init__ needs only the model)."""
    from asyncflow.engines.rollout import SamplingParams
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.models.loading import load_causal_lm, load_tokenizer
    from asyncflow.workers.rollout import RolloutWorker

    w = RolloutWorker.__new__(RolloutWorker)
    tok = load_tokenizer(model_dir)
    w.tokenizer = tok
    # eos unreachable: every row runs to its budget, so an interruption always leaves work
    w.engine = BuiltinRolloutEngine(load_causal_lm(model_dir), eos_token_ids=[tok.eos_token_id],
                                    pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        w.engine.model.lm_head.weight[tok.eos_token_id] -= 100.0
    w.engine.version = 0
    w.params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=())
    w.partial, w.receiver, w.local, w.seq, w.swaps, w.aborts = partial, None, True, 0, 0, 0
    return w


def test_interrupted_rows_continue_on_new_weights_with_token_versions(model_dir, monkeypatch):
    w = _worker(model_dir, partial=True)
    new = {k: v.clone() + 0.01 for k, v in w.engine.model.state_dict().items()}
    calls = {"n": 0}
    engine_generate = w.engine.generate

    def generate(prompts, params, **kw):
        calls["n"] += 1
        if calls["n"] == 1:  # newer weights arrive after the first decode steps of the first generation
            polled = {"n": 0}
            abort = kw["should_abort"]

            def should_abort():
                polled["n"] += 1
                if polled["n"] == 3:
                    ws.LOCAL_MAILBOX.put(ws.pack_weights(new, version=1, seq=1))
                return abort()
            kw["should_abort"] = should_abort
        return engine_generate(prompts, params, **kw)
    monkeypatch.setattr(w.engine, "generate", generate)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    out = w._generate(prompts, [11, 12])
    assert calls["n"] == 2 and w.aborts == 2 and w.engine.version == 1
    for ids, lp, vers in zip(out["response_ids"], out["behav_log_probs"], out["token_versions"]):
        assert len(ids) == len(lp) == len(vers) == 6  # the whole budget, across the interruption
        assert vers[0] == 0 and vers[-1] == 1 and torch.all(vers[1:] >= vers[:-1])
    assert out["gen_version"].tolist() == [0, 0]  # a row's version is its oldest token's


def test_without_partial_rollout_a_generation_runs_on_the_weights_it_started_with(model_dir):
    w = _worker(model_dir, partial=False)
    ws.LOCAL_MAILBOX.put(ws.pack_weights(w.engine.model.state_dict(), version=3, seq=99))
    out = w._generate([torch.tensor([5, 6, 7])], [1])
    assert w.aborts == 0 and out["token_versions"][0].tolist() == [0] * 6
