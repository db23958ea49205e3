"""LoRA versions on the built-in rollout engine: adapters merged into its weights.

A LoRA version (model.lora) carries ``<layer>.lora_A.weight`` ([rank, in]) and
``<layer>.lora_B.weight`` ([out, rank]) for every adapted layer, and the base weights only
when they changed (the first sync, a fold, a resumed checkpoint). The engine keeps an
unmerged copy of each adapted layer's base weight, taken the first time the layer gets an
adapter (and replaced by every base weight a later version sends), and sets
``W = base + scale * B @ A`` once the version is in: each version's adapters replace the
previous ones exactly, nothing accumulates. Decoding then runs on plain weights, at the
speed of a model without adapters; the cost is the base copy of the adapted layers.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["AdapterMerge", "adapter_layer", "is_adapter_name"]

_A, _B = ".lora_A.weight", ".lora_B.weight"


def adapter_layer(name: str) -> tuple[str, str] | None:
    """(the layer's name, "A" or "B") of an adapter tensor's name, else None."""
    for suffix, kind in ((_A, "A"), (_B, "B")):
        if name.endswith(suffix):
            return name[:-len(suffix)], kind
    return None


def is_adapter_name(name: str) -> bool:
    return adapter_layer(name) is not None


class AdapterMerge:
    """The adapters of a version into ``model``'s weights (``scale``: alpha / rank)."""

    def __init__(self, model: torch.nn.Module, scale: float):
        self.model = model
        self.scale = float(scale)
        self.base: dict[str, torch.Tensor] = {}  # layer weight name -> its unmerged base
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def check(self, tensors: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
        """Raise (naming the tensor) for adapters this model cannot take; changes nothing."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            found = adapter_layer(name)
            if found is not None:
                layer, kind = found
                pairs.setdefault(layer, {})[kind] = t
        for layer, ab in pairs.items():
            weight = target.get(layer + ".weight")
            if weight is None or weight.dim() != 2:
                raise KeyError(f"load_weights: adapter {layer!r} names no linear layer of the model")
            if set(ab) != {"A", "B"}:
                raise KeyError(f"load_weights: adapter {layer!r} comes without its lora_{'B' if 'A' in ab else 'A'}")
            a, b = ab["A"], ab["B"]
            out, inp = weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
                raise ValueError(f"load_weights: adapter {layer!r}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not fit the layer's weight {tuple(weight.shape)}")
            if a.dtype != weight.dtype or b.dtype != weight.dtype:
                raise TypeError(f"load_weights: adapter {layer!r} is {a.dtype}/{b.dtype}, the model holds "
                                f"{weight.dtype} (send weights in the rollout dtype)")

    def begin(self) -> None:
        self._pending = {}

    def take(self, name: str, t: torch.Tensor) -> bool:
        """An adapter tensor is kept for ``end`` (copied: the caller's buffer is reused); a base
        weight of an adapted layer also replaces its base copy. True: ``t`` was an adapter."""
        found = adapter_layer(name)
        if found is not None:
            layer, kind = found
            self._pending.setdefault(layer, {})[kind] = t.detach().clone()
            return True
        held = self.base.get(name)
        if held is not None:
            held.copy_(t)
        return False

    @torch.no_grad()
    def end(self, params: Mapping[str, torch.Tensor]) -> int:
        """Merge the version's adapters into the weights; returns the layers merged."""
        for layer, ab in self._pending.items():
            w = params[layer + ".weight"]
            base = self.base.get(layer + ".weight")
            if base is None:  # the weight holds the base still: this layer's first adapter
                base = self.base[layer + ".weight"] = w.detach().clone()
            delta = self.scale * (ab["B"].to(w.device, torch.float32) @ ab["A"].to(w.device, torch.float32))
            w.copy_((base.float() + delta).to(w.dtype))
        n, self._pending = len(self._pending), {}
        return n
