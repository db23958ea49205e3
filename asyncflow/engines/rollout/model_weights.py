"""The built-in engine's weights: check, load in place (whole or streamed), offload and restore.

A version's tensors are copied into the model's own parameters (no second copy of the
model); LoRA adapters, when the policy trains them, are merged into the base weights
(``lora_apply.py``). A stream that fails midway leaves the weights ``torn``: the engine then
refuses to generate until a version loads whole, never serving a mix. When the new version
takes effect for the running rows is the scheduler's (``builtin.py``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncflow.engines.rollout.lora_apply import AdapterMerge, is_adapter_name

__all__ = ["ModelWeights"]


class ModelWeights:
    """The weights of ``model`` on ``device``; ``lora_scale``: adapters may arrive (alpha / rank)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, lora_scale: float | None) -> None:
        self.model = model
        self.device = device
        self._lora = AdapterMerge(model, lora_scale) if lora_scale is not None else None
        self.torn: str | None = None  # why the weights are half-loaded (then the engine refuses to run)

    def check(self, state_dict: Mapping[str, Any], version: int, held: int) -> None:
        """Raise (naming the key) for weights the model would refuse (``held``: the version it
        has); changes nothing. Values are tensors or their metadata (shape and dtype)."""
        if int(version) < held:
            raise ValueError(f"load_weights: version {version} is older than the version held ({held}); "
                             "refused, the engine keeps its weights")
        target = self.model.state_dict()
        adapters = {k: v for k, v in state_dict.items() if is_adapter_name(k)}
        if adapters:
            if self._lora is None:
                raise KeyError(f"load_weights: LoRA adapters ({next(iter(adapters))!r}, ...) sent to an engine built "
                               "without LoRA (lora_scale)")
            self._lora.check(adapters, target)
            state_dict = {k: v for k, v in state_dict.items() if k not in adapters}
            if not state_dict:  # adapters only: the base weights held stay
                return
        unknown = sorted(k for k in state_dict if k not in target)
        if unknown:
            raise KeyError(f"load_weights: unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                           f"(expected the model's state_dict names, e.g. {next(iter(target))!r})")
        for k, v in state_dict.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"load_weights: {k!r} is a {type(v).__name__}, not a tensor")
            if tuple(v.shape) != tuple(target[k].shape):
                raise ValueError(f"load_weights: shape mismatch for {k!r}: got {tuple(v.shape)}, "
                                 f"the model has {tuple(target[k].shape)}")
            if v.dtype != target[k].dtype:
                raise TypeError(f"load_weights: dtype mismatch for {k!r}: got {v.dtype}, the model holds "
                                f"{target[k].dtype} (send weights in the rollout dtype)")
        # Tied weights (embeddings / LM head) are one tensor under two names: either name will do.
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for k, t in target.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(k)
        missing = sorted(names[0] for names in groups.values() if not any(n in state_dict for n in names))
        if missing:
            raise KeyError(f"load_weights: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                           f"({len(missing)} in all; a full state_dict is required)")

    def load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy checked weights into the model, in place (moved to the device as needed)."""
        target = self.model.state_dict()
        if self._lora is not None:
            self._lora.begin()
        with torch.no_grad():
            for k, v in state_dict.items():
                if self._lora is None or not self._lora.take(k, v):
                    target[k].copy_(v)
            if self._lora is not None:
                self._lora.end(target)

    def load_stream(self, specs: Sequence[Any], stream: Iterable[tuple[Any, torch.Tensor]], version: int) -> None:
        """Copy a checked version tensor by tensor as ``stream`` yields (spec, tensor); on a failure
        or a short stream the weights are ``torn`` and the error is raised."""
        target = self.model.state_dict()
        done = 0
        if self._lora is not None:
            self._lora.begin()
        try:
            with torch.no_grad():
                for spec, t in stream:
                    if self._lora is None or not self._lora.take(spec.name, t):
                        target[spec.name].copy_(t)
                    done += 1
                if self._lora is not None and done == len(specs):
                    self._lora.end(target)
        except BaseException as e:
            self.torn = f"version {version}: {done} of {len(specs)} tensors loaded when the stream failed: {e}"
            raise
        if done != len(specs):
            self.torn = f"version {version}: the stream ended after {done} of {len(specs)} tensors"
            raise RuntimeError(f"load_weights_stream: {self.torn}")
        self.torn = None

    def nbytes(self) -> int:
        """Bytes of the parameters and buffers, wherever they are."""
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])

    def offload(self) -> None:
        """On an accelerator, move the weights to host memory and return every free block to the
        device. On the CPU the colocated roles share this process's heap, so nothing moves."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            getattr(torch, self.device.type).empty_cache()

    def restore(self) -> None:
        """Bring offloaded weights back to the device."""
        if self.device.type != "cpu":
            self.model.to(self.device)
