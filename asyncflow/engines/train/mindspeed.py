"""MindSpeed adapter for Ascend NPUs. UNTESTED ON HARDWARE: no NPU and no MindSpeed here.

What it does, per MindSpeed's documentation: MindSpeed is Ascend's acceleration library;
its documented entry point is `import mindspeed.megatron_adaptor`, which must run
BEFORE anything imports megatron, and patches torch/megatron with NPU kernels and
features. MindSpeed also documents FSDP2 as a supported backend. This engine therefore
applies MindSpeed's adaptor and then runs the same FSDP2 training loop as `FSDPEngine`
on the 'npu' platform (hccl collectives, bf16 params / fp32 reduction).

What it does NOT do: it does not build Megatron-core models (no tensor/pipeline
parallelism, no Megatron checkpoints); the model stays the HF model from
`model_factory`, so weights, checkpoints and `export_hf` are interchangeable with
FSDPEngine's. Importing this module is free: mindspeed and torch_npu load when an
engine is built, and their absence raises ImportError naming `pip install asyncflow[npu]`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from asyncflow.engines.train.base import OptimConfig
from asyncflow.engines.train.fsdp import FSDPEngine
from asyncflow.engines.train.model_source import ModelSource
from asyncflow.engines.train.options import EngineOptions
from asyncflow.platform import Platform, get_platform

__all__ = ["MindSpeedEngine", "import_mindspeed"]

INSTALL_HINT = "pip install asyncflow[npu]"


def import_mindspeed() -> None:
    """Import torch_npu and apply `mindspeed.megatron_adaptor`; ImportError with the fix if absent.

    Must run before megatron is imported anywhere in the process (MindSpeed's rule).
    """
    for name in ("torch_npu", "mindspeed"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"MindSpeedEngine needs the '{name}' package, which cannot be imported ({exc}); "
                f"install the Ascend stack with `{INSTALL_HINT}` (CANN toolkit required), "
                "or use FSDPEngine"
            ) from exc
    importlib.import_module("mindspeed.megatron_adaptor")


class MindSpeedEngine(FSDPEngine):
    """FSDPEngine on Ascend NPUs with MindSpeed's adaptor applied. Same interface and
    arguments; `platform` defaults to (and must be) 'npu'."""

    def __init__(self, model_factory: ModelSource | Callable[[], nn.Module], optim: OptimConfig, *,
                 process_group: dist.ProcessGroup | None = None, platform: Platform | None = None,
                 mixed_precision: bool | None = None, value_head: bool = False,
                 options: EngineOptions | None = None) -> None:
        import_mindspeed()
        platform = platform if platform is not None else get_platform("npu")
        if platform.name != "npu":
            raise ValueError(f"MindSpeedEngine runs on the 'npu' platform, got {platform.name!r}; "
                             "use FSDPEngine elsewhere")
        super().__init__(model_factory, optim, process_group=process_group, platform=platform,
                         mixed_precision=mixed_precision, value_head=value_head, options=options)
