"""vLLM's supported path for new weights into a live model, as begin / load / finish.

vLLM (>= 0.20) reloads weights layer by layer: ``initialize_layerwise_reload`` puts each layer
back in its checkpoint layout, the model's ``load_weights`` fills it, and each layer is
processed again (repacked for the CPU kernels, re-quantized) once all its tensors arrived;
``finalize_layerwise_reload`` finishes the layers that never completed (attention). This is
what ``Worker.reload_weights`` runs for one iterator; split in three so that one version may
arrive in several calls (chunks, buckets).

A vLLM without that module (older CUDA builds) loads into the live parameters with
``load_weights``, which is correct where no processing changed them after the first load.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = ["Reload"]


class VLLMModel(Protocol):
    """What a reload calls on vLLM's model: its own loader of (HF name, tensor) pairs."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


def _layerwise() -> tuple[Any, Any] | None:
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _config_scope(vllm_config: Any) -> Any:
    if vllm_config is None:
        return contextlib.nullcontext()
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(vllm_config)


class Reload:
    """One version at a time into ``model`` (a vLLM worker's model) through vLLM's reload path."""

    def __init__(self, model: VLLMModel, runner: Any, vllm_config: Any) -> None:
        self.model, self.runner, self.vllm_config = model, runner, vllm_config
        self.api = _layerwise() if vllm_config is not None else None
        self.open = False
        self.loaded = 0

    def begin(self) -> None:
        """Open a version. After a version that failed midway (still open), the next one starts
        over: layers already waiting keep waiting, and what they get now is loaded after what
        they had, so the new tensors win."""
        if self.api is not None:
            with _config_scope(self.vllm_config), torch.no_grad():
                self.api[0](self.model)
        self.open, self.loaded = True, 0

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.open:
            raise RuntimeError("vLLM reload: load() outside begin() / finish()")
        counted = []

        def count() -> Iterable[tuple[str, torch.Tensor]]:
            for item in named:
                counted.append(1)
                yield item
        with _config_scope(self.vllm_config), torch.no_grad():
            self.model.load_weights(weights=count())
        self.loaded += len(counted)

    def finish(self) -> None:
        if not self.open:
            raise RuntimeError("vLLM reload: finish() without begin()")
        if self.api is not None:
            with _config_scope(self.vllm_config), torch.no_grad():
                self.api[1](self.model, self.vllm_config.model_config)
        self.open = False
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.runner, reset, None)
            if callable(fn):
                fn()
