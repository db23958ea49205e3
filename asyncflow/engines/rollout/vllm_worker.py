"""Runs inside vLLM's worker processes: the in-place weight update.

vLLM loads this class into every worker (`worker_extension_cls`), so the engine can
call `collective_rpc("asyncflow_load_weights", ...)` by name: no pickled callables, and
the same code works whatever the worker class (GPU, vllm-ascend NPU).
"""
from __future__ import annotations

import torch


class WeightLoaderExtension:
    """Mixed into vLLM's Worker; `self.model_runner` is the worker's."""

    def asyncflow_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model
        device = next(model.parameters()).device
        # The model's own load_weights maps HF names to vLLM's fused/sharded parameters
        # (qkv_proj, gate_up_proj, tensor-parallel slices).
        model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in named))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(named)
