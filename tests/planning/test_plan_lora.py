"""asyncflow plan with LoRA (--lora-rank): the adapters' count, the actor's memory (gradients
and optimizer state of the adapters only), no reference model, and sync bytes of the adapters."""
from __future__ import annotations

import pytest
from _plan_helpers import QWEN25_7B, QWEN25_32B, small

from asyncflow.planning import (
    CostAssumptions,
    Hardware,
    ModelShape,
    PlacementRequest,
    PlanInputs,
    RolloutSettings,
    TrainSettings,
    Workload,
    actor_memory,
    count_params,
)
from asyncflow.planning.params import lora_params
from asyncflow.planning.split import colocated, disaggregated


def test_adapter_count_by_hand():
    shape, _ = small()  # hidden 8, q 8, kv 4, ffn 16, 2 layers
    # per layer and rank: q 8+8, k 8+4, v 8+4, o 8+8, gate 8+16, up 8+16, down 16+8 = 128
    assert lora_params(shape, 1) == 128 * 2
    assert lora_params(shape, 4) == 4 * 128 * 2


@pytest.mark.parametrize("config,millions", [(QWEN25_7B, 20.185), (QWEN25_32B, 67.109)])
def test_adapters_of_qwen_at_rank_8(config, millions):
    # 7B: 28 layers x 8 x (2*3584 + 2*(3584+512) + 2*3584 + 3*(3584+18944)) ... as lora_params sums it
    shape = ModelShape.from_config(config)
    assert lora_params(shape, 8) / 1e6 == pytest.approx(millions, abs=1e-3)


def test_actor_memory_with_lora_keeps_only_the_base_parameters():
    shape, params = small()
    full = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10), shard=2)
    lora = actor_memory(shape, params, TrainSettings(micro_batch_tokens=10, lora_rank=1), shard=2)
    n, a = params.total, lora_params(shape, 1)
    assert lora.weights - full.weights == a * 2 // 2  # the adapters in bf16, sharded over two
    assert lora.gradients == a * 4 // 2 and full.gradients == n * 4 // 2
    assert lora.optimizer == a * (4 + 8) // 2 and full.optimizer == n * (4 + 8) // 2
    assert lora.activations == full.activations


@pytest.mark.parametrize("config", [QWEN25_7B, QWEN25_32B])
def test_plan_of_qwen_with_lora_drops_the_reference_and_syncs_the_adapters(config):
    shape = ModelShape.from_config(config)
    params = count_params(shape)
    hw = Hardware(count=8, memory_gib=80, peak_tflops=989, bandwidth_tbs=3.35, reserved_gib=0)
    work = Workload(prompts_per_step=32, responses_per_prompt=8, prompt_tokens=256, response_tokens=1024)
    cost = CostAssumptions(sync_gbs=1.0)
    rollout = RolloutSettings(tensor_parallel=1)

    def plan(rank: int):
        x = PlanInputs(shape=shape, params=params, hardware=hw, work=work, cost=cost, rollout=rollout,
                       train=TrainSettings(lora_rank=rank), placement=PlacementRequest(reference="actor"))
        return disaggregated(x, 4), colocated(x)

    (full, full_col), (lora, lora_col) = plan(0), plan(8)
    assert [r.role for r in full.sides["training"]] == ["actor", "reference"]
    assert [r.role for r in lora.sides["training"]] == ["actor"]
    assert lora.side_bytes["training"] < full.side_bytes["training"] / 2
    assert full.times.sync_s == pytest.approx(params.total * 2 / 1e9)
    assert lora.times.sync_s == pytest.approx(lora_params(shape, 8) * 2 / 1e9)
    # the reference's forward pass still runs, in the actor: the same training time
    assert lora.times.train_s == pytest.approx(full.times.train_s)
    assert "reference" in [r.role for r in full_col.sides["all"]]
    assert "reference" not in [r.role for r in lora_col.sides["all"]]
    assert lora_col.side_bytes["all"] <= full_col.side_bytes["all"]


def test_plan_cli_prints_the_lora_line(capsys):
    import argparse

    from asyncflow.planning.command import add_arguments, run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--lora-rank", "8"])) in (0, 1)
    out = capsys.readouterr().out
    assert "LoRA rank 8 on every linear layer" in out and "no reference model" in out
