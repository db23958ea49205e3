"""Where a training engine's model comes from: the architecture to build (on the meta device)
and the weights to fill its shards with (meta_init.py does both).

* `PretrainedModel`: a local Hugging Face directory. Every rank builds the model from its
  config.json with parameters on meta and reads its own rows of each tensor from the
  safetensors files; nothing is broadcast except what the files lack (a critic's new value
  head, rotary buffers).
* `FactorySource`: any callable returning a model (a random init such as the tests' models,
  or a loader). The group's first rank calls it for real weights and sends each tensor in
  turn; the other ranks call it with parameters on meta, so a random init needs no common
  seed and a loader reads nothing there. A plain callable passed to an engine becomes one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from asyncflow.engines.train.meta_init import WeightReader, parameters_on_meta
from asyncflow.engines.train.options import EngineOptions
from asyncflow.models.loading import SafetensorsWeights, read_causal_lm_config

__all__ = ["FactorySource", "ModelSource", "PretrainedModel", "as_model_source"]


@runtime_checkable
class ModelSource(Protocol):
    where: str  # names the weights in errors

    def build(self, rank: int) -> nn.Module:
        """The model; its parameters on meta, except on a rank that holds weights to send."""

    def weights(self) -> contextlib.AbstractContextManager[WeightReader | None]:
        """What each rank reads for itself (None: the first rank sends everything)."""


@dataclass
class FactorySource:
    factory: Callable[[], nn.Module]
    where: str = "the model factory's weights"

    def build(self, rank: int) -> nn.Module:
        if rank == 0:
            return self.factory()
        with parameters_on_meta():
            return self.factory()

    def weights(self) -> contextlib.AbstractContextManager[WeightReader | None]:
        return contextlib.nullcontext(None)


@dataclass
class PretrainedModel:
    """A causal LM in a local directory (config.json + safetensors), built on meta and loaded
    shard by shard. ``options``: how the engine should hold and run it (the config's model
    section), used when the engine is given none."""

    path: str
    attn_implementation: str | None = None
    options: EngineOptions | None = None

    @property
    def where(self) -> str:
        return f"the safetensors weights in {self.path}"

    def build(self, rank: int) -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = read_causal_lm_config(self.path, attn_implementation=self.attn_implementation)
        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def weights(self) -> contextlib.AbstractContextManager[WeightReader | None]:
        return SafetensorsWeights(self.path)


def as_model_source(model: Any) -> ModelSource:
    """A ModelSource as is; a callable as a FactorySource."""
    if isinstance(model, ModelSource):
        return model
    if callable(model):
        return FactorySource(model)
    raise TypeError(f"a training engine's model must be a ModelSource (e.g. PretrainedModel(path)) or a callable "
                    f"returning an nn.Module, got {type(model).__name__}")
