"""Bytes per device of each role: weights, gradients, optimizer state, activations, KV cache.

Estimates of what a role allocates, not measurements: allocator overhead and the runtime's
own buffers are the ``reserved`` part of a device (hardware.py). Activations are transient:
roles that share a device take turns, so a device holds every resident role's persistent
state plus the largest role's activations (``device_bytes``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from asyncflow.planning.params import ModelShape, ParamCount, lora_params
from asyncflow.planning.settings import RolloutSettings, TrainSettings, dtype_bytes

__all__ = ["ACTIVATION_BYTES", "CATEGORIES", "LOGIT_BYTES", "RoleMemory", "actor_memory", "device_bytes",
           "kv_bytes_per_token", "layer_saved_elements", "reference_memory", "rollout_memory"]

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "kv_cache")
ACTIVATION_BYTES = 2  # bf16 compute (FSDP2 mixed precision / autocast)
# Per token and vocabulary entry while log-probs are computed: bf16 logits, their fp32 copy and
# the fp32 log-softmax, all alive at once (engines/train/fsdp.py computes them unchunked).
LOGIT_BYTES = 2 + 4 + 4


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one device of the role holds; ``host`` is what it keeps in host memory instead."""
    role: str
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    host: int = 0

    @property
    def persistent(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.kv_cache

    @property
    def total(self) -> int:
        return self.persistent + self.activations


def layer_saved_elements(shape: ModelShape) -> int:
    """Elements per token one decoder layer keeps for its backward pass (flash/SDPA attention,
    so no seq x seq scores): the layer input and its normed copy, q, k, v, the attention output,
    the residual sum and its normed copy, and the MLP's gate, up, SiLU(gate) and product."""
    h, i = shape.hidden_size, shape.intermediate_size
    return 4 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 4 * i


def _gather_buffer(params: ParamCount, shard: int, from_host: bool = False) -> int:
    """Sharded FSDP gathers one unit for compute and prefetches the next: two of the largest
    units, in the compute dtype. Unsharded (one device) there is nothing to gather, unless the
    parameters live in host memory and are copied in unit by unit."""
    return 0 if shard == 1 and not from_host else 2 * params.largest_unit * ACTIVATION_BYTES


def actor_memory(shape: ModelShape, params: ParamCount, train: TrainSettings, shard: int) -> RoleMemory:
    """The training actor on one of ``shard`` devices its state is sharded over (FSDP)."""
    b, n = train.bytes_per_param(), params.total
    trained = n  # what has gradients and optimizer state
    if train.lora_rank:  # the adapters train; the base is held as its parameters only
        trained = lora_params(shape, train.lora_rank)
        n += trained
    optimizer_state = math.ceil(trained * (b["master"] + b["optimizer"]) / shard)
    tokens = train.micro_batch_tokens
    per_layer = layer_saved_elements(shape) * tokens * ACTIVATION_BYTES
    if train.activation_checkpointing:  # every layer's input, plus one layer recomputed in full
        layers = shape.num_layers * tokens * shape.hidden_size * ACTIVATION_BYTES + per_layer
    else:
        layers = shape.num_layers * per_layer
    activations = layers + tokens * shape.vocab_size * LOGIT_BYTES
    if train.cpu_offload:  # FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in host memory
        host = math.ceil(n * b["param"] / shard) + math.ceil(trained * b["grad"] / shard) + optimizer_state
        return RoleMemory(role="actor", weights=_gather_buffer(params, shard, from_host=True),
                          activations=activations, host=host)
    return RoleMemory(
        role="actor",
        weights=math.ceil(n * b["param"] / shard) + _gather_buffer(params, shard),
        gradients=math.ceil(trained * b["grad"] / shard),
        optimizer=0 if train.optimizer_offload else optimizer_state,
        activations=activations,
        host=optimizer_state if train.optimizer_offload else 0,
    )


def reference_memory(shape: ModelShape, params: ParamCount, train: TrainSettings, shard: int) -> RoleMemory:
    """A frozen copy of the policy (for the KL term), sharded like the actor; forward only, so
    it keeps one layer's intermediates and the logits of a micro-batch."""
    tokens = train.micro_batch_tokens
    return RoleMemory(
        role="reference",
        weights=math.ceil(params.total * dtype_bytes(train.param_dtype, "param_dtype") / shard)
        + _gather_buffer(params, shard),
        activations=tokens * (layer_saved_elements(shape) * ACTIVATION_BYTES + shape.vocab_size * LOGIT_BYTES),
    )


def kv_bytes_per_token(shape: ModelShape, dtype: str, tensor_parallel: int = 1) -> int:
    """K and V of every layer for one token on one device. Grouped-query attention stores
    num_key_value_heads heads, split over the tensor-parallel devices; with more devices than
    KV heads each device keeps a copy of one head (as vLLM does)."""
    heads_per_device = math.ceil(shape.num_kv_heads / tensor_parallel)
    return 2 * shape.num_layers * heads_per_device * shape.head_dim * dtype_bytes(dtype, "rollout dtype")


def rollout_memory(shape: ModelShape, params: ParamCount, rollout: RolloutSettings) -> RoleMemory:
    """One device of a rollout instance (``tensor_parallel`` devices) with every running row
    holding a full context of KV cache (the worst case the engine must be able to reach)."""
    tp, b = rollout.tp, dtype_bytes(rollout.dtype, "rollout dtype")
    kv = rollout.max_running_rows * rollout.context_length * kv_bytes_per_token(shape, rollout.dtype, tp)
    # One prefill chunk's widest intermediates (hidden in/out, q/k/v, gate/up), split by TP, and
    # the fp32 logits of every running row at sampling (the vocabulary is gathered whole).
    wide = 2 * shape.hidden_size + (shape.q_dim + 2 * shape.kv_dim + 2 * shape.intermediate_size) // tp
    activations = rollout.prefill_tokens * wide * b + rollout.max_running_rows * shape.vocab_size * 4
    return RoleMemory(role="rollout", weights=math.ceil(params.total * b / tp), activations=activations,
                      kv_cache=kv)


def device_bytes(roles: list[RoleMemory]) -> int:
    """What a device holding ``roles`` at once needs: their persistent state, and the largest
    activations (the roles of one device take turns)."""
    return sum(r.persistent for r in roles) + max((r.activations for r in roles), default=0)
