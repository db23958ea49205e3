"""What the planner is told: training and rollout settings, one RL step's work, the placement
and the cost assumptions. Each checks its own values and names the bad one."""
from __future__ import annotations

from dataclasses import dataclass

from asyncflow.planning.params import PlanInputError

__all__ = ["DTYPE_BYTES", "CostAssumptions", "PlacementRequest", "RolloutSettings", "TrainSettings", "Workload",
           "dtype_bytes"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(name: str, what: str, allow_none: bool = False) -> int:
    if allow_none and name == "none":
        return 0
    if name not in DTYPE_BYTES:
        choices = [*DTYPE_BYTES, *(["none"] if allow_none else [])]
        raise PlanInputError(f"{what}: expected one of {choices}, got {name!r}")
    return DTYPE_BYTES[name]


def _at_least(what: str, value: float, low: float) -> None:
    if value < low:
        raise PlanInputError(f"{what}: must be >= {low}, got {value}")


@dataclass(frozen=True)
class TrainSettings:
    """The actor's training state. Defaults: bf16 parameters with an fp32 master copy, fp32
    gradients and fp32 AdamW moments (18 bytes per parameter before sharding). The FSDP2
    engine of AsyncFlow keeps fp32 sharded parameters as their own master copy and computes
    in bf16: param_dtype=fp32, master_dtype=none (16 bytes per parameter)."""
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    master_dtype: str = "fp32"  # or none
    optimizer_dtype: str = "fp32"  # AdamW's two moments
    fsdp_size: int = 0  # devices one copy is sharded over; 0: all training devices
    optimizer_offload: bool = False  # master copy and moments in host memory
    # FSDP2's CPUOffloadPolicy (model.cpu_offload): parameter shards, gradients and optimizer state
    # in host memory, units copied in for compute (the optimizer step runs on the host: slower,
    # which the cost model does not charge)
    cpu_offload: bool = False
    activation_checkpointing: bool = True  # keep each layer's input, recompute the rest in backward
    micro_batch_tokens: int = 8192  # tokens per forward/backward on one device (optim.micro_batch_tokens)
    ppo_epochs: int = 1  # passes of the update over a step's samples
    # model.lora.rank on every linear layer (0: full fine-tuning): the frozen base keeps only its
    # parameters; gradients, master copy and AdamW moments are the adapters'; no reference model
    # (the base with the adapters off); weight sync sends the adapters
    lora_rank: int = 0

    def __post_init__(self) -> None:
        self.bytes_per_param()
        _at_least("lora_rank", self.lora_rank, 0)
        _at_least("fsdp_size", self.fsdp_size, 0)
        _at_least("micro_batch_tokens", self.micro_batch_tokens, 1)
        _at_least("ppo_epochs", self.ppo_epochs, 1)

    def bytes_per_param(self) -> dict[str, int]:
        return {"param": dtype_bytes(self.param_dtype, "param_dtype"),
                "grad": dtype_bytes(self.grad_dtype, "grad_dtype"),
                "master": dtype_bytes(self.master_dtype, "master_dtype", allow_none=True),
                "optimizer": 2 * dtype_bytes(self.optimizer_dtype, "optimizer_dtype")}


@dataclass(frozen=True)
class RolloutSettings:
    dtype: str = "bf16"  # weights and KV cache
    tensor_parallel: int = 0  # devices per rollout instance; 0: try each valid size within a node
    max_running_rows: int = 256  # rows one instance decodes together (rollout.max_running_rows)
    context_length: int = 4096  # KV positions reserved per row: prompt + max new tokens
    prefill_tokens: int = 2048  # prompt tokens prefilled per step (rollout.prefill_chunk)

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype, "rollout dtype")
        _at_least("tensor_parallel", self.tensor_parallel, 0)
        for name in ("max_running_rows", "context_length", "prefill_tokens"):
            _at_least(name, getattr(self, name), 1)

    @property
    def tp(self) -> int:
        """The tensor-parallel size, once chosen (0 means "search", which split.candidates resolves)."""
        if self.tensor_parallel < 1:
            raise PlanInputError("tensor_parallel 0 (try each size) is resolved by split.candidates; "
                                 "pass a size to compute one instance's memory or time")
        return self.tensor_parallel


@dataclass(frozen=True)
class Workload:
    """One RL step, in means: its rollout time and training time scale with these."""
    prompts_per_step: int = 256
    responses_per_prompt: int = 8  # the GRPO group (rollout.n)
    prompt_tokens: int = 512
    response_tokens: int = 1024

    def __post_init__(self) -> None:
        _at_least("prompts_per_step", self.prompts_per_step, 1)
        _at_least("responses_per_prompt", self.responses_per_prompt, 1)
        _at_least("prompt_tokens", self.prompt_tokens, 0)
        _at_least("response_tokens", self.response_tokens, 1)

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.responses_per_prompt

    @property
    def generated_tokens(self) -> int:
        return self.samples * self.response_tokens

    @property
    def trained_tokens(self) -> int:
        return self.samples * (self.prompt_tokens + self.response_tokens)


PLACEMENTS = ("colocated", "disaggregated", "both")
REFERENCE_SIDES = ("none", "actor", "rollout")


@dataclass(frozen=True)
class PlacementRequest:
    mode: str = "disaggregated"  # colocated | disaggregated | both (compare them)
    rollout_devices: int | None = None  # disaggregated: a fixed split; None: search every split
    reference: str = "none"  # none | actor | rollout: where a reference model (KL) sits
    offload_idle: bool = True  # colocated: the idle role's state moves to host memory

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENTS:
            raise PlanInputError(f"placement: expected one of {PLACEMENTS}, got {self.mode!r}")
        if self.reference not in REFERENCE_SIDES:
            raise PlanInputError(f"reference: expected one of {REFERENCE_SIDES}, got {self.reference!r}")
        if self.rollout_devices is not None and self.mode != "disaggregated":
            raise PlanInputError(f"rollout_devices: a fixed split needs placement disaggregated, got {self.mode!r}")


@dataclass(frozen=True)
class CostAssumptions:
    """Efficiencies and link speeds of the cost model; a measured rate replaces the derived one."""
    train_mfu: float = 0.4  # achieved / peak FLOP/s for training and prefill (assumed)
    bandwidth_efficiency: float = 0.7  # achieved / peak memory bandwidth in decode (assumed)
    sync_gbs: float = 25.0  # weight sync, training -> rollout devices, GB/s (assumed)
    host_gbs: float = 25.0  # device <-> host copies for colocated offload, GB/s per device (assumed)
    rollout_tokens_per_s: float | None = None  # measured generated tokens/s per rollout device
    train_tokens_per_s: float | None = None  # measured trained tokens/s per training device, whole update

    def __post_init__(self) -> None:
        for name in ("train_mfu", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise PlanInputError(f"{name}: must lie in (0, 1], got {value}")
        for name in ("sync_gbs", "host_gbs", "rollout_tokens_per_s", "train_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise PlanInputError(f"{name}: must be > 0, got {value}")
