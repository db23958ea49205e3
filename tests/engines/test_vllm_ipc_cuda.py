"""A colocated vLLM instance's weight handover through CUDA IPC, across a real process boundary
on one GPU: the engine's ``load_weights_stream`` sends device tensors as IPC handles, and the
real WeightLoaderExtension in a second (spawned) process maps them on its own device and loads
them. vLLM itself is replaced by that process and a stand-in model; the CUDA side is real.
Skipped without CUDA (runs in scripts/device_check.sh's GPU tests)."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from torch import nn

from asyncflow.engines.rollout.vllm import VLLMRolloutEngine
from asyncflow.engines.rollout.vllm_worker import WeightLoaderExtension
from asyncflow.weight_sync.protocol import make_header
from tests.engines.test_rollout_vllm import SPECS, TIED, FakeLLMEngine, fake_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TIMEOUT_S = 60


class _CudaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1, device="cuda"))  # the device the worker loads onto
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            assert t.is_cuda, f"{name} arrived on {t.device}"
            self.loaded[name] = t.clone()


class _Worker(WeightLoaderExtension):
    def __init__(self) -> None:
        self.rank = 0
        self.model_runner = type("Runner", (), {"model": _CudaModel()})()

    def dump(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.model_runner.model.loaded.items()}


def _serve(conn) -> None:
    """The worker process: run each (method, args) it is sent on the extension, reply with the result."""
    worker = _Worker()
    while (msg := conn.recv()) is not None:
        method, args = msg
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as e:  # noqa: BLE001 - sent back to the test, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _OtherProcessLLM:
    """vllm.LLM reduced to collective_rpc over one worker in another process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        self.llm_engine = FakeLLMEngine()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.conn.send((method, args))
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"worker process: no answer to {method} within {TIMEOUT_S} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker process, {method}: {value}")
        return [value]

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(TIMEOUT_S)


def test_device_tensors_reach_a_worker_in_another_process_as_ipc_handles():
    llm = _OtherProcessLLM()
    try:
        engine = VLLMRolloutEngine.from_llm(llm, SPECS, TIED, fake_params)
        g = torch.Generator().manual_seed(3)
        sd = {"embed.weight": torch.randn(4, 2, generator=g).cuda(),
              "layer.weight": torch.randn(2, 2, generator=g).cuda()}
        header = make_header(sd.items(), 1, 1, 1 << 20, 1, None)
        engine.load_weights_stream(header.specs, zip(header.specs, sd.values()), 1, chunk_bytes=16)
        assert engine.version == 1 and engine.torn is None
        loaded = llm.collective_rpc("dump")[0]
        assert set(loaded) == set(sd)
        for k, t in sd.items():  # cast to the engine's dtype on the sender, mapped unchanged on the receiver
            assert torch.equal(loaded[k], t.to(torch.bfloat16).cpu()), k
    finally:
        llm.close()
