"""How a training engine holds and runs its model: the ``model`` config section's engine keys.

Master weights, gradient reduction and the optimizer state are float32 in every setting;
``param_dtype`` is the dtype FSDP2 gathers parameters in for forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PARAM_DTYPES", "EngineOptions"]

PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class EngineOptions:
    param_dtype: str = "auto"  # auto: bfloat16 on accelerators, float32 on CPU | bfloat16 | float32
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    cpu_offload: bool = False  # FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in host memory
    padding_free: bool = False  # micro-batches of packed sequences instead of right-padded rows

    def __post_init__(self) -> None:
        if self.param_dtype != "auto" and self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"model.param_dtype {self.param_dtype!r}: expected auto, "
                             f"{' or '.join(PARAM_DTYPES)}")

    @classmethod
    def from_model_config(cls, model: Any) -> EngineOptions:
        """From the run config's ``model`` section (asyncflow.config.ModelConfig)."""
        return cls(param_dtype=model.param_dtype, activation_checkpointing=model.activation_checkpointing,
                   cpu_offload=model.cpu_offload, padding_free=model.padding_free)

    def compute_dtype(self, on_accelerator: bool) -> torch.dtype:
        """The dtype parameters are gathered in for compute on this platform."""
        if self.param_dtype == "auto":
            return torch.bfloat16 if on_accelerator else torch.float32
        return PARAM_DTYPES[self.param_dtype]
