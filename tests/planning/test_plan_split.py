"""The split a cost setting solvable by hand predicts fastest, memory ruling splits out, the
colocated sum, and what the advice says to change."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from _plan_helpers import QWEN25_7B, QWEN25_32B, SMALL_PARAMS, small

from asyncflow.planning import (
    CostAssumptions,
    Hardware,
    ModelShape,
    PlacementRequest,
    PlanInputError,
    PlanInputs,
    RolloutSettings,
    TrainSettings,
    Workload,
    count_params,
    make_plan,
)
from asyncflow.planning.hardware import GIB
from asyncflow.planning.split import colocated, disaggregated, tensor_parallel_sizes

# 6 samples of 1000 generated tokens and no prompt: 6000 tokens generated and 6000 trained per step.
# At 1000 generated and 3000 trained tokens/s per device: rollout 6/R s, training 2/T s (R + T = 8).
# Weight sync moves the bf16 weights (2 * 2824 bytes) at 2 * 2824 bytes/s: 1 s.
WORK = Workload(prompts_per_step=6, responses_per_prompt=1, prompt_tokens=0, response_tokens=1000)
RATES = CostAssumptions(rollout_tokens_per_s=1000, train_tokens_per_s=3000, sync_gbs=2 * SMALL_PARAMS / 1e9)
ROLLOUT = RolloutSettings(tensor_parallel=1, max_running_rows=3, context_length=5, prefill_tokens=7)


def inputs(usable_bytes: int = 10 * GIB, **kw) -> PlanInputs:
    shape, params = small()
    hw = Hardware(count=8, memory_gib=usable_bytes / GIB, peak_tflops=1, bandwidth_tbs=1, reserved_gib=0)
    return PlanInputs(shape=shape, params=params, hardware=hw, work=WORK,
                      **{"cost": RATES, "rollout": ROLLOUT, "train": TrainSettings(micro_batch_tokens=10), **kw})


def test_balanced_split_is_chosen():
    plan = make_plan(inputs())
    # R=6: max(1, 1) + 1 = 2; R=5: max(1.2, 0.67) + 1 = 2.2; R=7: max(0.86, 2) + 1 = 3
    assert (plan.chosen.rollout_devices, plan.chosen.train_devices) == (6, 2)
    assert plan.chosen.times.step_s == pytest.approx(2.0)
    # R=4: 1.5 + 1; R=3: 2 + 1; R=2: max(3, 0.33) + 1; R=1: max(6, 0.29) + 1
    steps = {c.rollout_devices: c.times.step_s for c in plan.candidates}
    assert steps == pytest.approx({6: 2.0, 5: 2.2, 4: 2.5, 3: 3.0, 7: 3.0, 2: 4.0, 1: 7.0})
    assert [c.times.step_s for c in plan.candidates] == sorted(steps.values())
    assert plan.advice == []


def test_memory_rules_out_the_fastest_split():
    # training devices need, at FSDP 2: 2824 + 3200 + 5648 + 16944 + 12720 = 41336 bytes;
    # at FSDP 3: 1883 + 3200 + 3766 + 11296 + 12720 = 32865. With 40000 usable, 2 is too few.
    plan = make_plan(inputs(usable_bytes=40000))
    assert plan.candidates[-1].rollout_devices == 7 and not plan.candidates[-1].fits
    by_split = {c.rollout_devices: c for c in plan.candidates}
    assert by_split[6].side_bytes["training"] == 41336 and not by_split[6].fits
    assert by_split[5].side_bytes["training"] == 32865 and by_split[5].fits
    assert plan.chosen.rollout_devices == 5 and plan.chosen.times.step_s == pytest.approx(2.2)


def test_colocated_is_the_sum_and_both_compares():
    x = inputs(placement=PlacementRequest(mode="both", offload_idle=False))
    col = colocated(x)
    assert (col.times.rollout_s, col.times.train_s, col.times.sync_s) == (0.75, 0.25, 0.0)
    assert col.times.step_s == pytest.approx(1.0)
    assert make_plan(x).chosen.placement == "colocated"
    # offload: the actor's bf16 weight shard (2824 * 2 / 8 = 706) and optimizer state (2824 * 12 / 8 = 4236)
    # at FSDP 8, and the rollout's weights (5648), go to host and back once per step, at 2824 bytes/s
    offload_inputs = inputs(placement=PlacementRequest(mode="colocated"), cost=CostAssumptions(
        rollout_tokens_per_s=1000, train_tokens_per_s=3000, host_gbs=SMALL_PARAMS / 1e9))
    offload = colocated(offload_inputs)
    assert offload.times.switch_s == pytest.approx(2 * (706 + 4236 + 5648) / SMALL_PARAMS)
    # with --cpu-offload the training state lives in host memory already: only the rollout's weights move
    host = colocated(replace(offload_inputs, train=TrainSettings(micro_batch_tokens=10, cpu_offload=True)))
    assert host.times.switch_s == pytest.approx(2 * 5648 / SMALL_PARAMS)


def test_fixed_split_and_invalid_splits():
    plan = make_plan(inputs(placement=PlacementRequest(rollout_devices=3)))
    assert [(c.rollout_devices, c.train_devices) for c in plan.candidates] == [(3, 5)]
    with pytest.raises(PlanInputError, match="rollout_devices 8"):
        make_plan(inputs(placement=PlacementRequest(rollout_devices=8)))
    assert disaggregated(inputs(train=TrainSettings(fsdp_size=4)), 6) is None  # 2 training devices, shard 4
    with pytest.raises(PlanInputError, match="tensor_parallel 3 does not divide num_attention_heads 2"):
        make_plan(inputs(rollout=RolloutSettings(tensor_parallel=3)))
    with pytest.raises(PlanInputError, match="fixed split needs placement disaggregated"):
        PlacementRequest(mode="colocated", rollout_devices=2)


def test_advice_gives_the_values_that_fit():
    # 10000 bytes usable, 1 rollout device: training at FSDP 7 with the optimizer offloaded needs
    # 807 + 3200 + 1614 + (32 + 240 + 1000) = 6893 and fits; rollout with 10 rows needs
    # 5648 + 896 + 10 * (5 * 32 + 400) = 12144. Rows r fit while 6544 + 560 r <= 10000: r <= 6.
    # TP 2 halves the weights: 2824 + 7 * 40 * 2 + 10 * 400 + 10 * 160 = 8984 fits.
    x = inputs(usable_bytes=10000, placement=PlacementRequest(rollout_devices=1),
               train=TrainSettings(micro_batch_tokens=1, optimizer_offload=True),
               rollout=RolloutSettings(tensor_parallel=1, max_running_rows=10, context_length=5, prefill_tokens=7))
    plan = make_plan(x)
    assert plan.chosen is None and plan.shown.side_bytes == {"training": 6893, "rollout": 12144}
    text = "\n".join(plan.advice)
    assert "rollout side needs" in text and "training" not in text
    assert "--max-running-rows 6 or less (now 10)" in text
    assert "--context-length" not in text  # no context length makes 10 rows fit
    assert "--tensor-parallel 2 (now 1)" in text


def test_training_advice_for_qwen_7b_on_one_training_device():
    shape = ModelShape.from_config(QWEN25_7B)
    x = PlanInputs(shape=shape, params=count_params(shape), placement=PlacementRequest(rollout_devices=7),
                   hardware=Hardware(count=8, memory_gib=80, peak_tflops=989, bandwidth_tbs=3.35))
    plan = make_plan(x)
    assert plan.chosen is None
    text = "\n".join(plan.advice)
    # 7.62 B params x 18 bytes = 128 GiB on one device: neither checkpointing nor micro-batches help.
    # At FSDP 2: 7.62 B x 2 / 2 + 2 x 0.545 B x 2 (gather) + 7.62 B x 16 / 2 + 14.6 GiB activations
    # = 86.4 GB = 80.5 GiB > 76 usable; at FSDP 3: 63.7 GiB fits.
    assert "--micro-batch-tokens" not in text and "--activation-checkpointing" not in text
    assert "--optimizer-offload" in text and "shard the training state over 3 devices or more" in text
    # with everything in host memory one device holds the two gathered 545 M-parameter units in bf16
    # (2.0 GiB) and 14.6 GiB of activations
    assert "--cpu-offload (needs 16.7 GiB;" in text


@pytest.mark.parametrize("config, sizes", [
    (QWEN25_7B, [1, 2, 4]),  # 28 heads, 4 KV heads: 7 divides the heads but not the KV heads
    (QWEN25_32B, [1, 2, 4, 8]),  # 40 heads, 8 KV heads: 5 divides the heads, not the KV heads
])
def test_tensor_parallel_sizes_tried_within_a_node(config, sizes):
    shape = ModelShape.from_config(config)
    x = PlanInputs(shape=shape, params=count_params(shape), hardware=Hardware(64, 80, 989, 3.35))
    assert tensor_parallel_sizes(x) == sizes
    assert tensor_parallel_sizes(replace(x, hardware=Hardware(64, 80, 989, 3.35, devices_per_node=2))) == [1, 2]


def test_auto_tensor_parallel_picks_the_size_that_fits():
    # the advice case above with 2 rollout devices: TP 1 needs 12144 bytes (over 10000), TP 2 8984;
    # training at FSDP 6: 942 + 3200 + 1883 + 1272 = 7297 fits
    x = inputs(usable_bytes=10000, placement=PlacementRequest(rollout_devices=2),
               train=TrainSettings(micro_batch_tokens=1, optimizer_offload=True),
               rollout=RolloutSettings(tensor_parallel=0, max_running_rows=10, context_length=5, prefill_tokens=7))
    plan = make_plan(x)
    assert [(c.tensor_parallel, c.fits) for c in plan.candidates] == [(2, True), (1, False)]
    assert plan.chosen.side_bytes == {"training": 7297, "rollout": 8984}


def test_beyond_one_node_splits_are_whole_nodes():
    x = inputs()  # 8 devices, 8 per node: any split into whole instances
    assert sorted(c.rollout_devices for c in make_plan(x).candidates) == [1, 2, 3, 4, 5, 6, 7]
    two_nodes = replace(x, hardware=replace(x.hardware, count=24))
    assert sorted(c.rollout_devices for c in make_plan(two_nodes).candidates) == [8, 16]
    fixed = replace(two_nodes, placement=PlacementRequest(rollout_devices=3))  # a fixed split may cut a node
    assert [c.rollout_devices for c in make_plan(fixed).candidates] == [3]


@pytest.mark.parametrize("side, chosen, step", [
    # the reference forward, 6000 tokens x 2 x 2024 matmul parameters at 0.4 x peak, takes 1/devices s here
    ("actor", 5, 1.2 + 1),  # R=5: max(1.2, 2/3 + 1/3) + 1; R=6: max(1, 1 + 1/2) + 1 = 2.5
    ("rollout", 6, 1 + 1 / 6 + 1),  # R=6: max(1 + 1/6, 1) + 1; R=5: max(1.2 + 0.2, 2/3) + 1 = 2.4
])
def test_reference_adds_its_forward_and_weights_where_it_sits(side, chosen, step):
    x = inputs(placement=PlacementRequest(reference=side))
    x = replace(x, hardware=replace(x.hardware, peak_tflops=6000 * 2 * 2024 / (1e12 * 0.4)))
    plan = make_plan(x)
    assert plan.chosen.rollout_devices == chosen and plan.chosen.times.step_s == pytest.approx(step)
    roles = {s: [r.role for r in rs] for s, rs in plan.chosen.sides.items()}
    assert "reference" in roles["training" if side == "actor" else "rollout"]
    # its bf16 weights sharded over the devices of its side (6 rollout or 3 training), plus the gather buffer
    ref = plan.chosen.sides["rollout" if side == "rollout" else "training"][1]
    assert ref.weights == math.ceil(SMALL_PARAMS * 2 / (6 if side == "rollout" else 3)) + 3200


def test_colocated_advice():
    # colocated at FSDP 8, 10 micro-batch tokens without checkpointing. Actor: 706 + 3200 weights,
    # 1412 gradients, 4236 optimizer, 2 * 120 * 10 * 2 + 10000 = 14800 activations (24354 in all);
    # rollout: 5648 weights + 480 KV cache + 2096 activations. Every role at once: 15682 + 14800 = 30482.
    no_ckpt = TrainSettings(micro_batch_tokens=10, activation_checkpointing=False)
    x = inputs(usable_bytes=27000, train=no_ckpt, placement=PlacementRequest(mode="colocated", offload_idle=False))
    plan = make_plan(x)
    assert plan.chosen is None and plan.shown.side_bytes == {"all": 30482}
    assert len(plan.advice) == 1 and "--offload-idle" in plan.advice[0]  # each side alone fits
    offloaded = make_plan(replace(x, placement=PlacementRequest(mode="colocated")))
    assert offloaded.chosen.side_bytes == {"all": 24354}  # the training phase, the larger one
    # 20000 usable: activations are 1480 bytes per token over 9554 persistent, so 7 tokens fit
    text = "\n".join(make_plan(replace(x, hardware=replace(x.hardware, memory_gib=20000 / GIB)),).advice)
    assert "--micro-batch-tokens 7 or less (now 10)" in text and "--activation-checkpointing" in text
    assert "shard the training state" not in text  # FSDP already spans all 8 devices
    assert "--cpu-offload" in text
