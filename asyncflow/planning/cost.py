"""Seconds per RL step on each side, from FLOPs and bytes moved (or from measured rates).

- Training: 6 FLOPs per parameter and token for forward + backward (Kaplan et al. 2020, "Scaling
  Laws for Neural Language Models"), 2 more with activation checkpointing (the recomputed
  forward), times the PPO epochs, plus one forward (2 per parameter) for the old log-probs;
  run at ``train_mfu`` of peak. Attention-score FLOPs are left out (a few percent at 4k context).
- Generation: each decode step of an instance reads its weights and the running rows' KV cache
  once (memory-bound) or does 2 FLOPs per parameter per row (compute-bound), whichever is
  slower; prompts are prefilled at ``train_mfu``. Continuous batching keeps ``max_running_rows``
  busy; the long tail of the last rows is not modelled (async mode overlaps it with training).
- Weight sync: the rollout-dtype weights over one link of ``sync_gbs``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from asyncflow.planning.hardware import Hardware
from asyncflow.planning.memory import kv_bytes_per_token
from asyncflow.planning.params import ModelShape, ParamCount
from asyncflow.planning.settings import CostAssumptions, RolloutSettings, TrainSettings, Workload, dtype_bytes

__all__ = ["forward_seconds", "rollout_seconds", "sync_seconds", "train_flops_per_token", "train_seconds"]


def train_flops_per_token(params: ParamCount, train: TrainSettings) -> float:
    per_pass = (6 + (2 if train.activation_checkpointing else 0)) * params.matmul
    return per_pass * train.ppo_epochs + 2 * params.matmul


def train_seconds(params: ParamCount, train: TrainSettings, work: Workload, hw: Hardware,
                  cost: CostAssumptions, devices: int) -> float:
    """The actor's update of one step (log-prob forward and the epochs) on ``devices``."""
    if cost.train_tokens_per_s is not None:
        return work.trained_tokens / (devices * cost.train_tokens_per_s)
    flops = work.trained_tokens * train_flops_per_token(params, train)
    return flops / (devices * hw.peak_tflops * 1e12 * cost.train_mfu)


def forward_seconds(params: ParamCount, work: Workload, hw: Hardware, cost: CostAssumptions, devices: int) -> float:
    """One forward pass over a step's samples (the reference model's log-probs)."""
    return work.trained_tokens * 2 * params.matmul / (devices * hw.peak_tflops * 1e12 * cost.train_mfu)


@dataclass(frozen=True)
class DecodeStep:
    rows: int  # rows decoded together by one instance
    seconds: float
    bound: str  # memory | compute


def decode_step(shape: ModelShape, params: ParamCount, rollout: RolloutSettings, work: Workload, hw: Hardware,
                cost: CostAssumptions, rows: int) -> DecodeStep:
    tp = rollout.tp
    mean_context = work.prompt_tokens + work.response_tokens / 2
    read = (params.total * dtype_bytes(rollout.dtype, "rollout dtype") / tp
            + rows * mean_context * kv_bytes_per_token(shape, rollout.dtype, tp))
    memory_s = read / (hw.bandwidth_tbs * 1e12 * cost.bandwidth_efficiency)
    compute_s = 2 * params.matmul * rows / tp / (hw.peak_tflops * 1e12 * cost.train_mfu)
    return DecodeStep(rows, max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute")


def rollout_seconds(shape: ModelShape, params: ParamCount, rollout: RolloutSettings, work: Workload,
                    hw: Hardware, cost: CostAssumptions, devices: int) -> float:
    """Generating one step's samples on ``devices`` (``devices // tensor_parallel`` instances,
    the samples shared out evenly)."""
    if cost.rollout_tokens_per_s is not None:
        return work.generated_tokens / (devices * cost.rollout_tokens_per_s)
    instances = devices // rollout.tp
    per_instance = math.ceil(work.samples / instances)
    step = decode_step(shape, params, rollout, work, hw, cost, min(rollout.max_running_rows, per_instance))
    decode_steps = math.ceil(per_instance * work.response_tokens / step.rows)
    prefill_s = (per_instance * work.prompt_tokens * 2 * params.matmul / rollout.tensor_parallel
                 / (hw.peak_tflops * 1e12 * cost.train_mfu))
    return prefill_s + decode_steps * step.seconds


def sync_seconds(params: ParamCount, rollout: RolloutSettings, cost: CostAssumptions, synced: int = 0) -> float:
    """One version over the wire: ``synced`` parameters (LoRA's adapters), else the whole model."""
    return (synced or params.total) * dtype_bytes(rollout.dtype, "rollout dtype") / (cost.sync_gbs * 1e9)
