"""Bytes per device of each role, for the small hand-made config, worked out by hand."""
from __future__ import annotations

import pytest
from _plan_helpers import QWEN25_7B, QWEN25_32B, SMALL_PARAMS, small

from asyncflow.planning import (
    ModelShape,
    RolloutSettings,
    TrainSettings,
    actor_memory,
    kv_bytes_per_token,
    reference_memory,
    rollout_memory,
)
from asyncflow.planning.memory import device_bytes, layer_saved_elements

P = SMALL_PARAMS  # 2824
# FSDP's gather buffer when sharded: two of the largest unit (the 800-parameter embedding) in bf16
GATHER = 2 * 800 * 2
# activations of 10 micro-batch tokens: saved per layer per token 4*8 + 2*8 + 2*4 + 4*16 = 120 elements;
# logits 10 tokens x 100 vocab x (2 + 4 + 4) bytes = 10000
LOGITS = 10 * 100 * 10


def test_actor_sharded_over_two_with_checkpointing():
    shape, params = small()
    assert layer_saved_elements(shape) == 120
    mem = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10), shard=2)
    assert mem.weights == P * 2 // 2 + GATHER  # bf16 shard + gather buffer
    assert mem.gradients == P * 4 // 2  # fp32
    assert mem.optimizer == P * (4 + 8) // 2  # fp32 master + two fp32 moments
    # checkpointing: each of 2 layers keeps its input (10 x 8 bf16), one layer recomputed whole
    assert mem.activations == 2 * 10 * 8 * 2 + 120 * 10 * 2 + LOGITS == 12720
    assert mem.host == 0 and mem.kv_cache == 0
    assert mem.total == 6024 + 5648 + 16944 + 12720


def test_actor_without_checkpointing_offloaded_and_unsharded():
    shape, params = small()
    full = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10, activation_checkpointing=False), 2)
    assert full.activations == 2 * 120 * 10 * 2 + LOGITS
    offload = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10, optimizer_offload=True), 2)
    assert (offload.optimizer, offload.host) == (0, P * 12 // 2)
    alone = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10), 1)
    assert alone.weights == P * 2  # nothing to gather on one device
    cpu = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10, cpu_offload=True), 2)
    # only the two gathered units are on the device; shards (2824), fp32 gradients (5648), optimizer (16944)
    # in host memory
    assert (cpu.weights, cpu.gradients, cpu.optimizer, cpu.host) == (GATHER, 0, 0, 2824 + 5648 + 16944)
    assert actor_memory(shape, params, TrainSettings(cpu_offload=True), 1).weights == GATHER  # copied in unit by unit
    engine = TrainSettings(param_dtype="fp32", master_dtype="none")  # the FSDP2 engine's layout: 16 B/param
    one = actor_memory(shape, params, engine, 1)
    assert one.weights + one.gradients + one.optimizer == 16 * P


def test_reference_is_weights_and_a_forward():
    shape, params = small()
    ref = reference_memory(shape, params, TrainSettings(micro_batch_tokens=10), 2)
    assert (ref.weights, ref.gradients, ref.optimizer) == (P + GATHER, 0, 0)
    assert ref.activations == 10 * 120 * 2 + LOGITS


def test_rollout_weights_kv_and_activations():
    shape, params = small()
    assert kv_bytes_per_token(shape, "bf16") == 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 KV head of 4, bf16
    settings = RolloutSettings(tensor_parallel=1, max_running_rows=3, context_length=5, prefill_tokens=7)
    mem = rollout_memory(shape, params, settings)
    assert mem.weights == P * 2
    assert mem.kv_cache == 3 * 5 * 32
    # 7 prefill tokens x (2*8 + 8 + 2*4 + 2*16) bf16, and 3 rows x 100 vocab fp32 logits
    assert mem.activations == 7 * 64 * 2 + 3 * 100 * 4
    # TP 2 with one KV head: each device keeps a copy of it, so KV per token does not halve
    tp2 = rollout_memory(shape, params, RolloutSettings(tensor_parallel=2, max_running_rows=3, context_length=5,
                                                        prefill_tokens=7))
    assert (tp2.weights, tp2.kv_cache) == (P, 3 * 5 * 32)
    assert tp2.activations == 7 * (16 + 48 // 2) * 2 + 3 * 100 * 4


@pytest.mark.parametrize("config, per_token", [
    (QWEN25_7B, 2 * 28 * 4 * 128 * 2),  # 56 KiB: GQA keeps 4 of 28 heads
    (QWEN25_32B, 2 * 64 * 8 * 128 * 2),  # 256 KiB
])
def test_kv_cache_per_token_of_qwen(config, per_token):
    shape = ModelShape.from_config(config)
    assert kv_bytes_per_token(shape, "bf16") == per_token
    assert kv_bytes_per_token(shape, "fp8") == per_token // 2
    assert kv_bytes_per_token(shape, "bf16", tensor_parallel=4) == per_token // 4
    mha = ModelShape.from_config({**config, "num_key_value_heads": config["num_attention_heads"]})
    assert kv_bytes_per_token(mha, "bf16") == per_token * config["num_attention_heads"] // config["num_key_value_heads"]


def test_roles_of_a_device_take_turns_for_activations():
    shape, params = small()
    actor = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10), 2)
    ref = reference_memory(shape, params, TrainSettings(micro_batch_tokens=10), 2)
    assert device_bytes([actor, ref]) == actor.persistent + ref.persistent + max(actor.activations, ref.activations)
    assert device_bytes([]) == 0
