"""weight_sync.load=in_place: a version streams tensor by tensor into the engine's own weights
while the service pauses generation; rows running across it carry exact per-token versions.
Refused specs change nothing; a stream that breaks midway leaves the engine refusing to run."""
from __future__ import annotations

import time

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.weight_sync.protocol import TensorSpec, make_header
from asyncflow.weight_sync.send import BucketSender
from asyncflow.weight_sync.sinks import InPlaceSink
from tests.engines._rollout_helpers import prompts
from tests.engines.test_rollout_service import service  # noqa: F401 - the fixture: in-flight swaps, rows to their budget

LONG = SamplingParams(max_new_tokens=60, temperature=1.0)


def _new_weights(engine, scale: float) -> dict[str, torch.Tensor]:
    return {k: v * scale if v.is_floating_point() else v.clone() for k, v in engine.model.state_dict().items()}


def test_a_version_streams_in_place_mid_generation_with_exact_token_versions(service):
    engine = service.engine
    new = _new_weights(engine, 1.01)
    futs = [service.submit(GenerationRequest(i, p, LONG, seed=i, max_new_tokens=60))
            for i, p in enumerate(prompts(4, seed=3))]
    while engine.counters["tokens"] < 8:
        time.sleep(0.001)
    sink = InPlaceSink(service, timeout_s=30, depth=2)
    sender = BucketSender(0, 0, None, lambda: [sink], timeout_s=30)
    header = make_header(new.items(), version=1, seq=1, bucket_bytes=4096, n_sources=1, cast=None)
    sender.send(header, list(new.items()))
    assert sink.loaded is header and sink.result["version"] == 1 and engine.version == 1
    held = engine.model.state_dict()
    assert all(torch.equal(held[k], new[k]) for k in new)
    results = [f.result(60) for f in futs]
    for r in results:
        v = r.token_versions.tolist()
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v)  # old tokens, then new: one switch
    assert [p[2] for p in service.pauses] == [1]


def test_refused_specs_leave_the_weights_and_version_untouched(service):
    engine = service.engine
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    wrong = [TensorSpec("lm_head.weight", (3, 3), "float32")]
    fut = service.update_weights_stream(wrong, iter(()), 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        fut.result(30)
    assert engine.version == 0 and engine.torn is None
    assert all(torch.equal(engine.model.state_dict()[k], before[k]) for k in before)


def test_a_stream_failing_midway_makes_the_engine_refuse_to_generate(service):
    engine = service.engine
    new = _new_weights(engine, 2.0)
    header = make_header(new.items(), 1, 1, 1 << 20, 1, None)

    def broken():
        for i, item in enumerate(zip(header.specs, new.values())):
            if i == 3:
                raise ConnectionError("peer closed")
            yield item
    fut = service.update_weights_stream(header.specs, broken(), 1)
    with pytest.raises(ConnectionError):
        fut.result(30)
    assert engine.torn is not None and "3 of" in engine.torn and engine.version == 0
    with pytest.raises(RuntimeError, match="half-loaded"):
        engine.step()
