"""``asyncflow plan``: the arguments, and from them a plan printed as text or JSON.

Exit status: 0 when a placement fits, 1 when none does (the report says what to change),
2 for unusable input (a missing config.json key, a bad flag value)."""
from __future__ import annotations

import argparse
import json
import sys

from asyncflow.planning.hardware import PRESETS, Hardware
from asyncflow.planning.params import ModelShape, PlanInputError, count_params, load_config_json, tiny_model_config
from asyncflow.planning.planner import Plan, make_plan
from asyncflow.planning.report import plan_dict, plan_text
from asyncflow.planning.settings import (
    DTYPE_BYTES,
    PLACEMENTS,
    REFERENCE_SIDES,
    CostAssumptions,
    PlacementRequest,
    RolloutSettings,
    TrainSettings,
    Workload,
)
from asyncflow.planning.split import PlanInputs

__all__ = ["add_arguments", "build_plan", "run"]

_ON_OFF = argparse.BooleanOptionalAction


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None (a flag that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsShown
    T, R, W, C = TrainSettings, RolloutSettings, Workload, CostAssumptions  # defaults come from the dataclasses
    parser.add_argument("model", nargs="?", default=None,
                        help="a model's config.json or its directory (none: the built-in tiny model)")
    dev = parser.add_argument_group("devices")
    dev.add_argument("--devices", type=int, default=8, help="accelerators in the run")
    dev.add_argument("--device", choices=sorted(PRESETS), default="h100",
                     help="preset for the three figures below (sources in docs/plan.md)")
    dev.add_argument("--device-memory-gb", type=float,
                     help="memory per device in GiB (preset: h100 80, a100 80, 910b 64)")
    dev.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per device (preset)")
    dev.add_argument("--memory-bandwidth-tbs", type=float, help="device memory bandwidth, TB/s (preset)")
    dev.add_argument("--devices-per-node", type=int, default=Hardware.devices_per_node,
                     help="a rollout instance's tensor parallelism stays within a node")
    dev.add_argument("--reserved-gb", type=float, default=Hardware.reserved_gib,
                     help="GiB per device kept for the runtime, collective buffers, fragmentation")
    place = parser.add_argument_group("placement")
    place.add_argument("--placement", choices=PLACEMENTS, default=PlacementRequest.mode,
                       help="colocated, disaggregated, or both to compare them")
    place.add_argument("--rollout-devices", type=int, help="disaggregated: a fixed number of rollout devices "
                                                           "(none: try every split)")
    place.add_argument("--reference", choices=REFERENCE_SIDES, default=PlacementRequest.reference,
                       help="a reference model for the KL term, on the actor's or the rollout's devices")
    place.add_argument("--offload-idle", action=_ON_OFF, default=PlacementRequest.offload_idle,
                       help="colocated: the idle side's state waits in host memory")
    train = parser.add_argument_group("training (the actor, FSDP over the training devices)")
    dtypes = sorted(DTYPE_BYTES)
    train.add_argument("--param-dtype", choices=dtypes, default=T.param_dtype, help="parameters on the device")
    train.add_argument("--grad-dtype", choices=dtypes, default=T.grad_dtype, help="gradients")
    train.add_argument("--master-dtype", choices=[*dtypes, "none"], default=T.master_dtype,
                       help="fp32 master copy of bf16 parameters (none: the parameters are the master)")
    train.add_argument("--optimizer-dtype", choices=dtypes, default=T.optimizer_dtype, help="AdamW's two moments")
    train.add_argument("--fsdp-size", type=int, default=T.fsdp_size,
                       help="devices one copy is sharded over (0: all training devices)")
    train.add_argument("--optimizer-offload", action=_ON_OFF, default=T.optimizer_offload,
                       help="master copy and moments in host memory")
    train.add_argument("--cpu-offload", action=_ON_OFF, default=T.cpu_offload,
                       help="FSDP2 CPUOffloadPolicy (model.cpu_offload): shards, gradients and optimizer state "
                            "in host memory")
    train.add_argument("--activation-checkpointing", action=_ON_OFF, default=T.activation_checkpointing,
                       help="keep only each layer's input for backward")
    train.add_argument("--micro-batch-tokens", type=int, default=T.micro_batch_tokens,
                       help="tokens per forward/backward on one device")
    train.add_argument("--ppo-epochs", type=int, default=T.ppo_epochs, help="passes over a step's samples")
    train.add_argument("--lora-rank", type=int, default=T.lora_rank,
                       help="LoRA adapters of this rank on every linear layer (model.lora.rank); 0: full fine-tuning")
    roll = parser.add_argument_group("rollout")
    roll.add_argument("--rollout-dtype", choices=dtypes, default=R.dtype, help="weights and KV cache")
    roll.add_argument("--tensor-parallel", type=int, default=R.tensor_parallel,
                      help="devices per rollout instance (0: try each size that divides the heads, within a node)")
    roll.add_argument("--max-running-rows", type=int, default=R.max_running_rows,
                      help="rows an instance decodes together")
    roll.add_argument("--context-length", type=int, default=R.context_length,
                      help="KV positions per row: prompt + max new tokens")
    roll.add_argument("--prefill-tokens", type=int, default=R.prefill_tokens, help="prompt tokens prefilled per step")
    work = parser.add_argument_group("one RL step (means)")
    work.add_argument("--prompts-per-step", type=int, default=W.prompts_per_step, help="prompts per RL step")
    work.add_argument("--responses-per-prompt", type=int, default=W.responses_per_prompt,
                      help="the GRPO group (rollout.n)")
    work.add_argument("--prompt-tokens", type=int, default=W.prompt_tokens, help="mean prompt length")
    work.add_argument("--response-tokens", type=int, default=W.response_tokens, help="mean response length")
    cost = parser.add_argument_group("cost model (assumptions; measured rates replace the derived ones)")
    cost.add_argument("--train-mfu", type=float, default=C.train_mfu,
                      help="achieved / peak FLOP/s, training and prefill")
    cost.add_argument("--bandwidth-efficiency", type=float, default=C.bandwidth_efficiency,
                      help="achieved / peak memory bandwidth in decode")
    cost.add_argument("--sync-gbs", type=float, default=C.sync_gbs, help="weight sync bandwidth, GB/s")
    cost.add_argument("--host-gbs", type=float, default=C.host_gbs, help="device <-> host, GB/s per device")
    cost.add_argument("--rollout-tokens-per-s", type=float, help="measured generated tokens/s per rollout device")
    cost.add_argument("--train-tokens-per-s", type=float, help="measured trained tokens/s per training device")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--top", type=int, default=10, help="candidates listed in the text report")


def build_plan(args: argparse.Namespace) -> Plan:
    if args.model:
        config, source = load_config_json(args.model)
    else:
        config, source = tiny_model_config(), "built-in tiny model"
    shape = ModelShape.from_config(config, source)
    memory, tflops, bandwidth = PRESETS[args.device]
    hardware = Hardware(count=args.devices, name=args.device, reserved_gib=args.reserved_gb,
                        devices_per_node=args.devices_per_node,
                        memory_gib=memory if args.device_memory_gb is None else args.device_memory_gb,
                        peak_tflops=tflops if args.peak_tflops is None else args.peak_tflops,
                        bandwidth_tbs=bandwidth if args.memory_bandwidth_tbs is None else args.memory_bandwidth_tbs)
    inputs = PlanInputs(
        shape=shape, params=count_params(shape), hardware=hardware,
        train=TrainSettings(param_dtype=args.param_dtype, grad_dtype=args.grad_dtype, master_dtype=args.master_dtype,
                            optimizer_dtype=args.optimizer_dtype, fsdp_size=args.fsdp_size,
                            optimizer_offload=args.optimizer_offload, cpu_offload=args.cpu_offload,
                            activation_checkpointing=args.activation_checkpointing,
                            micro_batch_tokens=args.micro_batch_tokens, ppo_epochs=args.ppo_epochs,
                            lora_rank=args.lora_rank),
        rollout=RolloutSettings(dtype=args.rollout_dtype, tensor_parallel=args.tensor_parallel,
                                max_running_rows=args.max_running_rows, context_length=args.context_length,
                                prefill_tokens=args.prefill_tokens),
        work=Workload(prompts_per_step=args.prompts_per_step, responses_per_prompt=args.responses_per_prompt,
                      prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens),
        placement=PlacementRequest(mode=args.placement, rollout_devices=args.rollout_devices,
                                   reference=args.reference, offload_idle=args.offload_idle),
        cost=CostAssumptions(train_mfu=args.train_mfu, bandwidth_efficiency=args.bandwidth_efficiency,
                             sync_gbs=args.sync_gbs, host_gbs=args.host_gbs,
                             rollout_tokens_per_s=args.rollout_tokens_per_s,
                             train_tokens_per_s=args.train_tokens_per_s))
    return make_plan(inputs, source)


def run(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except PlanInputError as err:
        print(f"asyncflow plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(plan), indent=2) if args.json else plan_text(plan, top=args.top))
    return 0 if plan.chosen else 1
