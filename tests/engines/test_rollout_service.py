"""RolloutService: one thread drives the engine; control calls from other threads are answered
between engine steps, never after a whole generation; a failing loop fails every waiter; a
streamed request gets its tokens step by step, all of them before its result."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.engines.rollout.service import RolloutService, ServiceError
from tests.engines._rollout_helpers import EOS, PAD, prompts, tiny_model

LONG = SamplingParams(max_new_tokens=100, temperature=1.0)


@pytest.fixture
def service():
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    engine = BuiltinRolloutEngine(tiny_model(tie=False), eos_token_ids=[EOS], pad_token_id=PAD)
    engine.eos_token_ids = ()  # rows run to their budget
    svc = RolloutService(engine, in_flight=True)
    yield svc
    svc.close()


def test_control_calls_are_answered_while_rows_generate(service):
    futs = [service.submit(GenerationRequest(i, p, LONG, seed=i, max_new_tokens=100))
            for i, p in enumerate(prompts(8, seed=2))]
    while service.engine.counters["tokens"] == 0:
        time.sleep(0.001)
    stats = service.stats()
    tokens_when_answered = service.engine.counters["tokens"]
    assert stats["running"] == 8 and not all(f.done() for f in futs)  # answered mid-generation
    assert service.abort("nobody") is False
    results = [f.result(60) for f in futs]
    assert all(len(r.response_ids) == 100 for r in results)
    assert tokens_when_answered < service.engine.counters["tokens"]  # generation went on after the answer


def test_a_newer_swap_replaces_one_not_yet_in(service):
    sd = dict(service.engine.model.state_dict())
    gate = threading.Event()
    holder = threading.Thread(target=lambda: service.call(lambda e: gate.wait(10)))
    holder.start()  # the loop is held inside a command: the two swaps below queue up behind it
    time.sleep(0.2)
    first = service.update_weights(sd, 1)
    second = service.update_weights(sd, 2)
    gate.set()
    holder.join(10)
    assert first.result(30) == {"version": 1, "superseded_by": 2, "pause_s": 0.0}
    assert second.result(30)["version"] == 2 and service.engine.version == 2
    r = service.submit(GenerationRequest("r", prompts(1)[0], LONG, max_new_tokens=3)).result(30)
    assert r.token_versions.tolist() == [2, 2, 2]


def test_a_failing_loop_fails_every_waiter(service, monkeypatch):
    def broken():
        raise RuntimeError("engine exploded")
    monkeypatch.setattr(service.engine, "step", broken)
    fut = service.submit(GenerationRequest("x", prompts(1)[0], LONG, max_new_tokens=3))
    with pytest.raises(ServiceError, match="engine exploded"):
        fut.result(30)
    with pytest.raises(ServiceError, match="engine exploded"):
        service.submit(GenerationRequest("y", prompts(1)[0], LONG, max_new_tokens=3))
    with pytest.raises(ServiceError):
        service.check()


def test_bad_swap_mode_is_refused(service):
    with pytest.raises(ValueError, match="mode must be one of"):
        service.update_weights({}, 1, mode="sideways")
    with pytest.raises(ValueError, match="swap_mode"):
        RolloutService(service.engine, swap_mode="sideways")
    assert torch.is_tensor(service.engine.model.lm_head.weight)


def test_a_streamed_request_gets_its_tokens_as_they_are_sampled_and_all_before_its_result(service):
    got: list[tuple[list[int], list[float], bool]] = []
    fut_box: list = []
    second = threading.Event()

    def on_tokens(ids: list[int], lps: list[float]) -> None:  # on the service thread
        got.append((ids, lps, fut_box[0].done()))
        if len(got) == 2:
            second.set()
    p = prompts(2, seed=5)
    fut_box.append(service.submit(GenerationRequest("s", p[0], LONG, seed=3, max_new_tokens=12), on_tokens=on_tokens))
    plain = service.submit(GenerationRequest("p", p[1], LONG, seed=4, max_new_tokens=12))
    assert second.wait(60)
    r = fut_box[0].result(60)
    plain.result(60)
    assert all(len(ids) == 1 for ids, _, _ in got)  # one token per decode step, not the whole row at the end
    assert not any(done for _, _, done in got)  # every token before the result
    assert [t for ids, _, _ in got for t in ids] == r.response_ids.tolist()
    assert torch.allclose(torch.tensor([x for _, lps, _ in got for x in lps]), r.log_probs)


def test_an_aborted_stream_ends_with_the_tokens_it_had_and_a_failing_listener_ends_only_its_stream(service):
    got: list[int] = []
    first = threading.Event()

    def on_tokens(ids: list[int], lps: list[float]) -> None:
        got.extend(ids)
        first.set()

    def broken(ids: list[int], lps: list[float]) -> None:
        raise RuntimeError("listener bug")
    p = prompts(2, seed=6)
    fut = service.submit(GenerationRequest("a", p[0], LONG, seed=1, max_new_tokens=100), on_tokens=on_tokens)
    other = service.submit(GenerationRequest("b", p[1], LONG, seed=2, max_new_tokens=5), on_tokens=broken)
    assert first.wait(60)
    assert service.abort("a") is True
    r = fut.result(60)
    assert r.finish_reason == "abort" and got == r.response_ids.tolist() and len(got) < 100
    assert len(other.result(60).response_ids) == 5  # its listener failed; the request and the service did not
    service.check()
