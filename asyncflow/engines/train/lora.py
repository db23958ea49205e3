"""LoRA on a training engine's policy: PEFT's low-rank adapters around chosen linear layers.

The engine wraps the model (still on the meta device) before sharding it, so FSDP2 shards
the frozen base weights and the adapters alike; only the adapters require gradients and only
they reach the optimizer. The names this module deals in:

* the wrapped model's (PEFT's): ``base_model.model.<layer>.base_layer.weight`` and
  ``base_model.model.<layer>.lora_A.default.weight``;
* the Hugging Face names (``hf_name``): ``<layer>.weight`` for the base, and
  ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` for the adapters: what checkpoints
  of the base hold, what weight sync sends and what the built-in rollout engine applies.

A layer's weight with its adapter is ``W + (alpha / rank) * B @ A`` (A: [rank, in], B: [out, rank]).
PEFT is imported only here, and only when ``model.lora`` is set.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from asyncflow.engines.train.meta_init import parameters_on_meta
from asyncflow.models.loading import read_causal_lm_config

__all__ = ["ALL_LINEAR", "LoraOptions", "adapter_layers", "fold_adapters", "hf_name", "initial_adapters",
           "is_adapter", "lora_model_problems", "merged_tensors", "save_adapter", "target_layers", "wrap"]

ALL_LINEAR = "all-linear"
_PREFIX = "base_model.model."
ADAPTER = "default"  # PEFT's name of the one adapter


@dataclass(frozen=True)
class LoraOptions:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0 or not self.target_modules:
            raise ValueError(f"LoraOptions: rank >= 1, alpha > 0, dropout in [0, 1) and a target module needed, "
                             f"got {self}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_model_config(cls, model: Any) -> LoraOptions | None:
        """From the run config's ``model`` section (its ``lora``); None when LoRA is off."""
        lo = model.lora
        if lo.rank is None:
            return None
        return cls(int(lo.rank), float(lo.alpha), float(lo.dropout), tuple(str(t) for t in lo.target_modules))


def hf_name(name: str) -> str:
    """A wrapped model's parameter name under the Hugging Face names (see the module docstring)."""
    name = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head of a Hugging Face model (never adapted); None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def _weight(module: object, what: str) -> Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise TypeError(f"LoRA layer {what}: {type(module).__name__} has no weight tensor")
    return weight


def target_layers(model: nn.Module, targets: tuple[str, ...] | list[str]) -> dict[str, nn.Linear]:
    """The linear layers ``targets`` name: a target matches a layer whose dotted name is it or
    ends in ``.<target>``; all-linear matches every linear layer but the LM head."""
    head = _output_embeddings(model)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if ALL_LINEAR in targets or any(name == t or name.endswith("." + t) for t in targets):
            out[name] = module
    return out


def lora_model_problems(model: nn.Module, opts: LoraOptions) -> list[str]:
    """What ``model.lora`` asks that this model cannot have, each naming the key to fix."""
    layers = target_layers(model, opts.target_modules)
    head = _output_embeddings(model)
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and m is not head})
    out = []
    for t in opts.target_modules:
        if t != ALL_LINEAR and not target_layers(model, (t,)):
            out.append(f"model.lora.target_modules: {t!r} matches no linear layer of the model (its linear layers "
                       f"are named {', '.join(linear)}; or all-linear)")
    if not layers and not out:
        out.append("model.lora.target_modules: the model has no linear layer to adapt")
    narrow = [(n, min(m.in_features, m.out_features)) for n, m in layers.items()
              if opts.rank > min(m.in_features, m.out_features)]
    if narrow:
        name, width = min(narrow, key=lambda x: x[1])
        out.append(f"model.lora.rank: {opts.rank} exceeds the width of layer {name} (min(in, out) = {width}); "
                   f"the rank must be at most {width} for the layers targeted")
    return out


def wrap(model: nn.Module, opts: LoraOptions) -> nn.Module:
    """``model`` inside PEFT's LoRA wrapper (its base frozen, the adapters trainable); refused
    with the key to fix when the targets or the rank do not fit the model."""
    from peft import LoraConfig, get_peft_model

    problems = lora_model_problems(model, opts)
    if problems:
        raise ValueError("; ".join(problems))
    names = sorted(target_layers(model, opts.target_modules))
    config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha,  # type: ignore[arg-type]  # peft annotates int, only divides it by r
                        lora_dropout=opts.dropout, target_modules=names)
    return get_peft_model(model, config)


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, Tensor, Tensor, Tensor]]:
    """(layer's HF name, base weight, A, B) of every adapted layer, in module order."""
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if isinstance(lora_a, nn.ModuleDict) and ADAPTER in lora_a:
            if not isinstance(lora_b, nn.ModuleDict):
                raise TypeError(f"LoRA layer {name}: lora_A comes without a lora_B ModuleDict")
            yield (hf_name(name + ".").rstrip("."), _weight(module.base_layer, name),
                   _weight(lora_a[ADAPTER], name), _weight(lora_b[ADAPTER], name))


@torch.no_grad()
def initial_adapters(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """Values for the adapters still on the meta device (a model built without weights):
    A as PEFT initialises it (Kaiming-uniform, seeded), B zero, so the model starts as its base.
    The group's first rank sends them (meta_init.fill)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.device.type != "meta" or not is_adapter(name):
            continue
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)): bound = 1 / sqrt(fan_in)
            out[name] = torch.empty(p.shape, dtype=p.dtype).uniform_(-bound, bound, generator=gen)
        else:
            out[name] = torch.zeros(p.shape, dtype=p.dtype)
    return out


def _whole(t: Tensor) -> Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: Tensor) -> Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _delta(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """This rank's rows of ``scale * B @ A``: B is sharded by rows as the base weight is (both
    have ``out`` rows, split the same way); A is gathered whole (a collective)."""
    return scale * (_local(b).float() @ _whole(a).float())


@torch.no_grad()
def merged_tensors(model: nn.Module, named: list[tuple[str, Tensor]], scale: float) -> list[tuple[str, Tensor]]:
    """The model's tensors with every adapter merged into its base weight, under the HF names
    and in ``named``'s order (the adapters themselves left out): what an engine that takes no
    adapters loads. A sharded weight stays sharded (each rank merges its own rows). A collective
    with FSDP: every rank of the group calls it."""
    from torch.distributed.tensor import DTensor  # slow to import: only LoRA runs pay for it

    merged = {}
    for _layer, w, a, b in adapter_layers(model):
        rows = (_local(w).float() + _delta(a, b, scale)).to(w.dtype)
        merged[id(w)] = (DTensor.from_local(rows, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())
                         if isinstance(w, DTensor) else rows)
    return [(hf_name(k), merged.get(id(v), v)) for k, v in named if not is_adapter(k)]


@torch.no_grad()
def fold_adapters(model: nn.Module, scale: float) -> int:
    """Merge every adapter into its base weight and zero its B: the model computes what it did,
    its base is now that model (the reference from here on) and its adapters start again from
    zero. Returns the layers folded. A collective with FSDP."""
    n = 0
    for _, w, a, b in adapter_layers(model):
        _local(w).add_(_delta(a, b, scale).to(w.dtype))
        _local(b).zero_()
        n += 1
    return n


def save_adapter(path: str | Path, state: dict[str, Tensor], opts: LoraOptions, base_model: str = "") -> None:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) from a full
    state dict of the wrapped model (PEFT's names): ``PeftModel.from_pretrained(base, path)``
    loads it."""
    from peft import LoraConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layers = sorted({hf_name(k).rsplit(".lora_", 1)[0] for k in state if is_adapter(k)})
    LoraConfig(r=opts.rank, lora_alpha=opts.alpha,  # type: ignore[arg-type]  # peft annotates int, only divides it by r
               lora_dropout=opts.dropout, target_modules=layers,
               base_model_name_or_path=base_model or None).save_pretrained(str(path))
    tensors = {k.replace(f".{ADAPTER}.", "."): v.contiguous() for k, v in state.items() if is_adapter(k)}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})


def merge_state_dict(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A full state dict of the wrapped model (PEFT's names, whole tensors) as the merged
    model's, under the HF names: each adapted weight is ``W + scale * B @ A``."""
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        if is_adapter(k):
            continue
        name = hf_name(k)
        if k.endswith(".base_layer.weight"):
            layer = k[:-len(".base_layer.weight")]
            a, b = state.get(f"{layer}.lora_A.{ADAPTER}.weight"), state.get(f"{layer}.lora_B.{ADAPTER}.weight")
            if a is not None and b is not None:
                v = (v.float() + scale * (b.float() @ a.float())).to(v.dtype)
        out[name] = v
    return out


def model_dir_problems(path: str | Path, opts: LoraOptions) -> list[str]:
    """lora_model_problems of the causal LM in ``path``, built on the meta device (no weights
    read): what the launcher checks before any rank starts."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(read_causal_lm_config(path), dtype=torch.float32)
    return lora_model_problems(model, opts)
