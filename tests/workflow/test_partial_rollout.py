"""Partial rollout is in-flight weight swapping: a rollout service swaps newer weights in at a
decode-step boundary and its running rows go on; every token keeps the version that made
it. Without partial rollout the service drains its running batch before swapping."""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from asyncflow.engines.rollout.base import GenerationRequest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, intermediate_size=128))


@pytest.fixture
def make_worker(model_dir):
    """Builds service workers; their service threads stop when the test ends."""
    made = []

    def make(partial: bool, **kw):
        made.append(service_worker(model_dir, partial, **kw))
        return made[-1]
    yield make
    for w in made:
        w.service.close()


def service_worker(model_dir, partial: bool, max_new_tokens: int = 6, eos: bool = False):
    """A RolloutWorker's engine and service, built without the runtime (no ranks, no queue)."""
    from asyncflow.engines.rollout import SamplingParams
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.engines.rollout.service import RolloutService
    from asyncflow.models.loading import load_causal_lm, load_tokenizer
    from asyncflow.workers.rollout import RolloutWorker

    w = RolloutWorker.__new__(RolloutWorker)
    tok = load_tokenizer(model_dir)
    w.tokenizer = tok
    w.engine = BuiltinRolloutEngine(load_causal_lm(model_dir), eos_token_ids=[tok.eos_token_id],
                                    pad_token_id=tok.pad_token_id)
    if not eos:  # no stop token: every row runs to its budget, so a swap always meets running rows
        w.engine.eos_token_ids = ()
    w.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=())
    w.service = RolloutService(w.engine, in_flight=partial)
    w._call_ids, w.sync_timeout_s = itertools.count(), 60.0
    return w


def _new_weights(w):
    return {k: v.clone() + 0.01 for k, v in w.engine.model.state_dict().items()}


def _submit(w, n: int, budget: int, seed0: int = 0) -> list:
    return [w.service.submit(GenerationRequest(("t", seed0 + i), torch.tensor([5, 6, 7 + i]), w.params, seed0 + i,
                                               budget)) for i in range(n)]


def _wait_tokens(w, at_least: int) -> None:
    end = time.monotonic() + 30
    while w.engine.counters["tokens"] < at_least:
        w.service.check()
        assert time.monotonic() < end, "the service generated nothing"
        time.sleep(0.001)


def test_running_rows_continue_on_new_weights_with_token_versions(make_worker):
    w = make_worker(partial=True)
    futs = _submit(w, 2, budget=100)
    _wait_tokens(w, 4)
    swap = w.service.update_weights(_new_weights(w), 1).result(30)
    out = [f.result(60) for f in futs]
    for r in out:
        assert len(r.response_ids) == len(r.log_probs) == len(r.token_versions) == 100  # the whole budget
        v = r.token_versions
        assert v[0] == 0 and v[-1] == 1 and torch.all(v[1:] >= v[:-1])
        assert r.gen_version == 0  # a row's version is its oldest token's
    assert swap["version"] == 1 and swap["pause_s"] < 5
    assert len(w.service.pauses) == 1


def test_without_partial_rollout_the_batch_drains_before_the_swap(make_worker):
    w = make_worker(partial=False)
    futs = _submit(w, 2, budget=100)
    _wait_tokens(w, 4)
    swap = w.service.update_weights(_new_weights(w), 3)
    later = _submit(w, 1, budget=5, seed0=10)  # queued behind the swap: it runs on the new weights
    out = [f.result(60) for f in futs]
    assert all(r.token_versions.tolist() == [0] * 100 for r in out)
    assert swap.result(30)["version"] == 3
    assert later[0].result(60).token_versions.tolist() == [3] * 5
    start, end, version = w.service.pauses[0]
    assert version == 3 and end > start


def test_refused_weights_keep_the_service_serving(make_worker):
    w = make_worker(partial=True)
    futs = _submit(w, 1, budget=50)
    bad = {**_new_weights(w), "model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="shape mismatch"):
        w.service.update_weights(bad, 1).result(30)
    with pytest.raises(ValueError, match="older than the version held"):
        w.service.update_weights(_new_weights(w), -1).result(30)
    r = futs[0].result(60)
    assert r.token_versions.tolist() == [0] * 50 and w.engine.version == 0
    assert w.service.abort(("nobody", 1)) is False and w.service.stats()["unknown_aborts"] == 1


def test_generate_wraps_the_service_with_per_row_budgets(make_worker):
    w = make_worker(partial=False, max_new_tokens=9)
    data = {"prompt_ids": [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([4])],
            "seed": torch.tensor([1, 2, 3]), "max_new_tokens": torch.tensor([2, 9, 5])}
    out = w.generate(data, 0)
    assert [len(r) for r in out["response_ids"]] == [2, 9, 5]
    out = w.generate({"prompt_ids": [torch.tensor([5, 6, 7])], "seed": torch.tensor([1])}, 0)
    assert [len(r) for r in out["response_ids"]] == [9]
    assert out["gen_version"].tolist() == [0]
