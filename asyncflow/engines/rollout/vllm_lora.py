"""LoRA versions through vLLM's own LoRA support (``model.lora.vllm=adapters``).

The engine is built with ``enable_lora``, one adapter slot (``max_loras=1``) and the smallest
``max_lora_rank`` vLLM offers that holds the policy's rank. The policy is ONE vLLM adapter, under
one id for the whole run (`POLICY_ID`): every request carries its `LoRARequest`, and each synced
version replaces that adapter's tensors in every worker (`AdapterSlot.install`), so that

- requests generate with the adapter of the version held, and only one adapter is ever held
  (the previous one is removed before the new one takes its slot: memory does not grow);
- a swap acts on running requests as a weight swap does (docs/architecture.md, weight sync):
  vLLM fixes a request's adapter id when the request is added, so a new id per version would
  leave running rows on the old adapter; under one id they continue with the new one, on
  their KV cache (``keep``) or prefilled again (``recompute``), and the per-version prefix-cache
  salt (vllm_requests.py) keeps new requests off blocks of older versions.

Version 0 (before any sync) is the base: the slot holds a zero adapter. A version carries
``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` under the Hugging Face layer names for
every adapted layer, and the base weights too when they changed (first sync, fold, resume):
those go through vLLM's weight reload, which drops vLLM's adapters, so the adapter is
installed after the base. The adapters are built in memory (``LoRAModel.from_lora_tensors``,
what vLLM's own loader calls after reading an adapter directory), never written to disk.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import torch

from asyncflow.engines.rollout.lora_apply import adapter_layer, is_adapter_name

__all__ = ["POLICY_ID", "POLICY_NAME", "AdapterSlot", "LoraSpec", "check_lora_version", "engine_lora_args",
           "vllm_lora_problems"]

POLICY_ID = 1  # vLLM adapter ids start at 1
POLICY_NAME = "asyncflow-policy"
# LoRARequest needs a path; the adapter is installed in memory before any request names it,
# so vLLM never reads this one.
_IN_MEMORY = "asyncflow://in-memory-adapter"
_PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The policy's adapters as vLLM must hold them: their rank and alpha (scale alpha / rank)."""

    rank: int
    alpha: float

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"LoraSpec: rank >= 1 and alpha > 0 needed, got {self}")


def _vllm_ranks() -> tuple[int, ...] | None:
    """The values vLLM's ``max_lora_rank`` takes (None: any)."""
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return None
    ranks = tuple(int(r) for r in typing.get_args(MaxLoRARanks))
    return tuple(sorted(ranks)) or None


def max_lora_rank(rank: int, allowed: tuple[int, ...] | None) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds ``rank`` (ValueError above its largest)."""
    if allowed is None:
        return int(rank)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank={rank}: vLLM's LoRA takes ranks up to {max(allowed)}; "
                         f"set model.lora.vllm=merged or a smaller rank")
    return fits[0]


def engine_lora_args(spec: LoraSpec, allowed: tuple[int, ...] | None = None) -> dict[str, Any]:
    """vLLM engine arguments for one policy adapter of ``spec``'s rank."""
    allowed = _vllm_ranks() if allowed is None else allowed
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": max_lora_rank(spec.rank, allowed)}


def lora_request() -> Any:
    from vllm.lora.request import LoRARequest
    return LoRARequest(POLICY_NAME, POLICY_ID, _IN_MEMORY)


def vllm_lora_problems(architectures: list[str], rank: int) -> list[str]:
    """Why the installed vLLM cannot take this run's adapters (``model.lora.vllm=adapters``),
    one line each naming the key; imports vLLM."""
    from vllm.platforms import current_platform
    out = []
    try:
        current_platform.get_punica_wrapper()
    except NotImplementedError:
        out.append(f"model.lora.vllm=adapters: vLLM has no LoRA kernels on {current_platform.device_type}; "
                   f"set model.lora.vllm=merged (the merged weights are sent instead)")
    try:
        max_lora_rank(rank, _vllm_ranks())
    except ValueError as e:
        out.append(str(e))
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora
        for arch in architectures:
            cls = ModelRegistry._try_load_model_cls(arch)
            if cls is not None and not supports_lora(cls):
                out.append(f"model.lora.vllm=adapters: vLLM's {arch} has no LoRA support; set model.lora.vllm=merged")
    except (ImportError, AttributeError):  # a vLLM without these: the engine's build says it
        pass
    return out


def check_lora_version(state: Mapping[str, Any], specs: Mapping[str, Any], tied: list[list[str]],
                       spec: LoraSpec, check_base: Any) -> None:
    """Refuse a LoRA version that does not fit the model (names, shapes), before anything is
    loaded: adapters must come in A/B pairs of ``spec.rank`` for 2-D weights of the model and
    cover every layer of a previous version (``state`` maps names to tensors or their metadata).
    Base weights, when present, are checked by ``check_base`` (the full-state-dict check)."""
    pairs: dict[str, dict[str, Any]] = {}
    base = {}
    for name, t in state.items():
        found = adapter_layer(name)
        if found is None:
            base[name] = t
        else:
            pairs.setdefault(found[0], {})[found[1]] = t
    if base:
        check_base(base)
    for layer, ab in sorted(pairs.items()):
        w = specs.get(layer + ".weight")
        if w is None or len(w.shape) != 2:
            raise KeyError(f"load_weights: adapter {layer!r} names no linear layer of the model")
        if set(ab) != {"A", "B"}:
            raise KeyError(f"load_weights: adapter {layer!r} comes without its lora_{'B' if 'A' in ab else 'A'}")
        out, inp = w.shape
        a, b = tuple(ab["A"].shape), tuple(ab["B"].shape)
        if a != (spec.rank, inp) or b != (out, spec.rank):
            raise ValueError(f"load_weights: adapter {layer!r}: lora_A {a} and lora_B {b} do not fit the layer's "
                             f"weight {tuple(w.shape)} at rank {spec.rank} (expected {(spec.rank, inp)} and "
                             f"{(out, spec.rank)})")
        for kind in ("A", "B"):
            if not ab[kind].dtype.is_floating_point:
                raise TypeError(f"load_weights: adapter {layer!r} lora_{kind} is {ab[kind].dtype}, not floating")
    if not pairs and not base:
        raise KeyError("load_weights: an empty version")


class AdapterSlot:
    """Inside a vLLM worker: the policy's one adapter in the worker's LoRA manager."""

    def __init__(self, model_runner: Any, spec: LoraSpec) -> None:
        manager = getattr(model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("vLLM was built without enable_lora: it cannot take adapters")
        self.runner, self.spec = model_runner, spec
        self.manager = manager._adapter_manager  # the LRU manager the worker's requests read
        self.installed = 0  # versions installed (the zero adapter counts)

    def _replace(self, lora: Any) -> None:
        self.manager.remove_adapter(POLICY_ID)  # frees its slot: at most one adapter is held
        self.manager.add_adapter(lora)
        self.manager.activate_adapter(POLICY_ID)  # into a slot now, not at the next request
        self.installed += 1

    def install_zero(self) -> None:
        """A zero adapter: the model computes its base (version 0, or a base loaded alone)."""
        emb = getattr(self.manager.model, "embedding_modules", {})
        self._replace(self.manager.create_dummy_lora(POLICY_ID, self.spec.rank, emb))

    def install(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """The adapters of a version (HF names: ``<layer>.lora_A.weight``) as the policy's adapter;
        returns the layers installed."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        layers = sorted({found[0] for found in map(adapter_layer, tensors) if found is not None})
        helper = PEFTHelper.from_dict({"r": self.spec.rank, "lora_alpha": self.spec.alpha,
                                       "target_modules": [x.rsplit(".", 1)[-1] for x in layers]})
        helper.validate_legal(self.runner.lora_config)
        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "get_rename_mapper"):
            mapper = mapper.get_rename_mapper()
        named = {_PEFT_PREFIX + n: t.detach() for n, t in tensors.items() if is_adapter_name(n)}
        lora = LoRAModel.from_lora_tensors(POLICY_ID, named, helper, device="cpu",
                                           dtype=self.runner.lora_config.lora_dtype, weights_mapper=mapper)
        self._replace(lora)
        return len(layers)
