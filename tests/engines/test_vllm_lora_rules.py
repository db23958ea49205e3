"""The rules of LoRA through vLLM's own support (vllm_lora.py), without vLLM: the engine
arguments sized from model.lora, the check of a LoRA version before anything loads, every
request carrying the policy's adapter (re-added ones too), and the worker's order: base
weights through vLLM's reload first (only when the version has some), the adapters last.
The same against real vLLM: tests/engines/test_vllm_lora.py."""
from __future__ import annotations

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.engines.rollout.vllm import VLLMRolloutEngine, WeightSpec
from asyncflow.engines.rollout.vllm_lora import LoraSpec, check_lora_version, engine_lora_args, max_lora_rank
from asyncflow.engines.rollout.vllm_requests import VLLMRequests
from asyncflow.engines.rollout.vllm_worker import _Version

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks
SPEC = LoraSpec(rank=4, alpha=8.0)
SPECS = {"q.weight": WeightSpec((6, 5), torch.float32), "norm.weight": WeightSpec((5,), torch.float32)}


def test_engine_arguments_take_the_smallest_rank_vllm_offers_that_holds_the_policys():
    assert engine_lora_args(SPEC, RANKS) == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    assert max_lora_rank(8, RANKS) == 8 and max_lora_rank(9, RANKS) == 16 and max_lora_rank(5, None) == 5
    with pytest.raises(ValueError, match="model.lora.vllm=merged"):
        max_lora_rank(600, RANKS)


def _adapters(rank: int = 4, out: int = 6, inp: int = 5) -> dict[str, torch.Tensor]:
    return {"q.lora_A.weight": torch.zeros(rank, inp), "q.lora_B.weight": torch.zeros(out, rank)}


def test_a_lora_version_is_checked_before_anything_loads():
    bases = []
    check_lora_version(_adapters(), SPECS, [], SPEC, bases.append)
    assert bases == []  # adapters alone: no base check
    base = {"q.weight": torch.zeros(6, 5), "norm.weight": torch.zeros(5)}
    check_lora_version({**base, **_adapters()}, SPECS, [], SPEC, bases.append)
    assert list(bases[0]) == ["q.weight", "norm.weight"]  # the base goes to the full-state-dict check
    for bad, error, match in [
        (_adapters(rank=5), ValueError, "at rank 4"),
        (_adapters(out=7), ValueError, "do not fit"),
        ({"q.lora_A.weight": torch.zeros(4, 5)}, KeyError, "without its lora_B"),
        ({"norm.lora_A.weight": torch.zeros(4, 5), "norm.lora_B.weight": torch.zeros(5, 4)}, KeyError,
         "names no linear layer"),
        ({**_adapters(), "q.lora_B.weight": torch.zeros(6, 4, dtype=torch.int32)}, TypeError, "not floating"),
        ({}, KeyError, "empty version"),
    ]:
        with pytest.raises(error, match=match):
            check_lora_version(bad, SPECS, [], SPEC, bases.append)


class _Recorder:
    """vLLM's LLMEngine as far as VLLMRequests calls it, recording what add_request got."""

    def __init__(self) -> None:
        self.added: list[tuple[str, object]] = []

    def add_request(self, request_id, prompt, params, lora_request=None) -> None:
        self.added.append((request_id, lora_request))

    def abort_request(self, ids) -> None:
        pass

    def reset_prefix_cache(self) -> bool:  # an older vLLM: a recompute swap re-adds the rows
        return True

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> list:
        return []


def test_every_request_carries_the_policys_adapter_re_added_ones_too():
    eng = _Recorder()
    reqs = VLLMRequests(eng, lambda p, b, s: (b, s), current_version=lambda: 0, lora_request="POLICY")
    for i in range(3):
        reqs.add(GenerationRequest(f"r{i}", torch.tensor([3, 4]), SamplingParams(max_new_tokens=4), seed=i))
    reqs.step()
    reqs.after_swap("recompute")
    assert len(eng.added) == 6 and all(lr == "POLICY" for _, lr in eng.added)
    plain = _Recorder()
    reqs = VLLMRequests(plain, lambda p, b, s: (b, s), current_version=lambda: 0)
    reqs.add(GenerationRequest("x", torch.tensor([3]), SamplingParams(max_new_tokens=2), seed=0))
    reqs.step()
    assert plain.added == [("asyncflow-0", None)]


class _Reload:
    def __init__(self) -> None:
        self.calls: list = []

    def begin(self) -> None:
        self.calls.append("begin")

    def load(self, named) -> None:
        self.calls.append(("load", [n for n, _ in named]))

    def finish(self) -> None:
        self.calls.append("finish")


class _Slot:
    def __init__(self, log: list) -> None:
        self.log = log

    def install(self, tensors) -> None:
        self.log.append(("install", sorted(tensors)))

    def install_zero(self) -> None:
        self.log.append("zero")


def _load(has_base: bool, named: list[tuple[str, torch.Tensor]], slot: bool = True) -> list:
    r = _Reload()
    v = _Version(r, _Slot(r.calls) if slot else None, has_base)
    v.begin()
    v.load(iter(named))
    v.finish()
    return r.calls


def test_the_worker_reloads_the_base_only_when_a_version_has_it_and_installs_the_adapters_last():
    a = [(k, t) for k, t in _adapters().items()]
    assert _load(False, a) == [("install", ["q.lora_A.weight", "q.lora_B.weight"])]  # no reload at all
    base = [("q.weight", torch.zeros(6, 5))]
    assert _load(True, base + a) == ["begin", ("load", ["q.weight"]), "finish",
                                     ("install", ["q.lora_A.weight", "q.lora_B.weight"])]
    assert _load(True, base) == ["begin", ("load", ["q.weight"]), "finish", "zero"]  # the base alone: zero adapter
    assert _load(False, base, slot=False) == ["begin", ("load", ["q.weight"]), "finish"]  # no LoRA: as before
    with pytest.raises(RuntimeError, match="adapters only"):
        _load(False, a + base)


class _LLM:
    """A stand-in vLLM: the LLMEngine and collective_rpc."""

    def __init__(self) -> None:
        self.llm_engine = _Recorder()
        self.rpcs: list = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.rpcs.append((method, args))
        return [None]


def test_a_lora_engine_sets_up_the_workers_slot_and_refuses_adapters_without_lora():
    llm = _LLM()
    VLLMRolloutEngine.from_llm(llm, SPECS, [], lambda p, b, s: (b, s), lora=SPEC, lora_request="POLICY")
    assert llm.rpcs == [("asyncflow_lora_init", (4, 8.0))]
    plain = VLLMRolloutEngine.from_llm(_LLM(), SPECS, [], lambda p, b, s: (b, s))
    with pytest.raises(KeyError, match="unknown weight names"):
        plain.check_weights(_adapters(), 1)
