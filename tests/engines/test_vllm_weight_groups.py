"""The vLLM adapter's weight path through the training ranks' weight-sync group, with a
stand-in for vLLM: two tensor-parallel "workers" (the real WeightLoaderExtension over a stand-in
model) join a gloo WireGroup as members 1 and 2 and receive a version's buckets there, the
header checked by the engine first; refused weights are drained and leave the engine as it was;
a colocated instance's in-process tensors reach the workers in chunks."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from asyncflow.engines.rollout.vllm import VLLMRolloutEngine
from asyncflow.engines.rollout.vllm_worker import WeightLoaderExtension, ipc_args_on
from asyncflow.weight_sync.protocol import make_header
from asyncflow.weight_sync.send import BucketSender
from asyncflow.weight_sync.wire_group import WireGroup, open_store
from tests.engines.test_rollout_vllm import SPECS, TIED, FakeLLMEngine, fake_params


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # the device vLLM's model lives on
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            self.loaded[name] = t.clone()


class _Worker(WeightLoaderExtension):
    vllm_config = None  # no vLLM: the reload falls back to the model's load_weights

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.model_runner = type("Runner", (), {"model": _Model()})()


class _TPLLM:
    """vllm.LLM reduced to collective_rpc over 2 workers, run at once as vLLM's workers run."""

    def __init__(self) -> None:
        self.llm_engine = FakeLLMEngine()
        self.workers = [_Worker(0), _Worker(1)]
        self.pool = ThreadPoolExecutor(2)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        futs = [self.pool.submit(getattr(w, method), *args) for w in self.workers]
        return [f.result(60) for f in futs]


def _weights(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"embed.weight": torch.randn(4, 2, generator=g) * scale, "layer.weight": torch.randn(2, 2, generator=g)}


@pytest.fixture
def wired():
    llm = _TPLLM()
    engine = VLLMRolloutEngine.from_llm(llm, SPECS, TIED, fake_params, tensor_parallel_size=2)
    store, addr = open_store(1 + engine.weight_endpoints(), "gloo", "vllm-test", 30, host="127.0.0.1")
    made: dict = {}
    t = threading.Thread(target=lambda: made.setdefault("g", WireGroup(addr, 0, 30, store=store)))
    t.start()
    assert engine.join_weight_groups([addr.to_dict()], 1, 30.0) == [1, 2]
    t.join(30)
    yield engine, llm, BucketSender(0, 0, made["g"], list, timeout_s=30)


def _send_async(sender, sd, version, shapes_ok=True):
    named = list(sd.items()) if shapes_ok else [("embed.weight", torch.zeros(3, 3))] + list(sd.items())[1:]
    header = make_header(named, version, version, bucket_bytes=16, n_sources=1, cast=torch.bfloat16)
    out: dict = {}

    def run():
        try:
            out["stats"] = sender.send(header, named)
        except Exception as e:  # noqa: BLE001 - looked at by the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out, header


def test_every_tensor_parallel_worker_receives_the_version_in_its_own_memory(wired):
    engine, llm, sender = wired
    sd = _weights(3.0)
    t, out, header = _send_async(sender, sd, 1)
    got = engine.receive_weights("keep")
    t.join(30)
    assert "error" not in out and len(header.buckets) >= 2
    assert got == {"version": 1, "seq": 1, "buckets": len(header.buckets)} and engine.version == 1
    for w in llm.workers:
        loaded = w.model_runner.model.loaded
        assert set(loaded) == set(sd)
        assert all(torch.equal(loaded[k], sd[k].to(torch.bfloat16)) for k in sd)


def test_refused_weights_are_drained_and_the_engine_keeps_its_own(wired):
    engine, llm, sender = wired
    t, out, _ = _send_async(sender, _weights(1.0), 1, shapes_ok=False)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.receive_weights("keep")
    t.join(30)
    assert "error" not in out  # the sender finished: the workers drained every bucket
    assert engine.version == 0 and engine.torn is None
    assert all(not w.model_runner.model.loaded for w in llm.workers)
    # and the group still works for the next version
    t, out, _ = _send_async(sender, _weights(2.0), 2)
    assert engine.receive_weights("keep")["version"] == 2
    t.join(30)


def test_in_process_tensors_reach_the_workers_in_chunks():
    llm = _TPLLM()
    calls: list[int] = []
    run = llm.collective_rpc

    def counting(method, args=()):
        calls.append((method, len(args[0]) if args else 0))
        return run(method, args)
    llm.collective_rpc = counting
    engine = VLLMRolloutEngine.from_llm(llm, SPECS, TIED, fake_params)
    sd = _weights(5.0)
    header = make_header(sd.items(), 1, 1, 1 << 20, 1, None)
    engine.load_weights_stream(header.specs, zip(header.specs, sd.values()), 1, chunk_bytes=16)
    # one tensor a chunk at 16 bytes, between the opening and the closing of vLLM's reload
    assert engine.version == 1 and calls == [("asyncflow_begin_reload", 0), ("asyncflow_load_chunk", 1),
                                             ("asyncflow_load_chunk", 1), ("asyncflow_finish_reload", 0)]
    assert all(torch.equal(llm.workers[0].model_runner.model.loaded[k], sd[k].to(torch.bfloat16)) for k in sd)


def test_ipc_arguments_get_the_receivers_device_index():
    args = ("cls", (2,), (1,), 0, "storage", torch.float32, 3, b"handle", 8, 0, b"ref", 0, b"event", False)
    out = ipc_args_on(args, 0)
    assert out[6] == 0 and out[:6] == args[:6] and out[7:] == args[7:]
