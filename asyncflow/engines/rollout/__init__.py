"""Rollout engines: generate responses (with their log-probs) from token prompts.

`BuiltinRolloutEngine` (Hugging Face models, CPU first) and `VLLMRolloutEngine`
(vLLM / vllm-ascend) share the `RolloutEngine` interface. The engine classes are
resolved lazily so that importing this package costs only `base` (torch + dataclasses).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncflow.engines.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.engines.rollout.vllm import VLLMRolloutEngine

__all__ = ["BuiltinRolloutEngine", "GenerationOutput", "RolloutEngine", "SamplingParams", "VLLMRolloutEngine"]

_LAZY = {
    "BuiltinRolloutEngine": "asyncflow.engines.rollout.builtin",
    "VLLMRolloutEngine": "asyncflow.engines.rollout.vllm",
}


def __getattr__(name: str) -> Any:
    # PEP 562: import the engine module only when its class is first asked for.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
