"""The placements a run could use, their memory per device and predicted step time, and the
fastest that fits.

- disaggregated (the AsyncFlow paper's async mode): rollout and training devices apart; a step
  takes max(rollout, training) + weight sync, since generation of the next step runs while the
  current one trains. Every split into whole rollout instances (beyond one node: whole nodes)
  is a candidate, for each tensor-parallel size tried.
- colocated (verl's hybrid engine): every role on every device, taking turns; a step takes
  rollout + training (+ moving the idle role's state to host and back when ``offload_idle``).
  The in-place weight update is not charged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from asyncflow.planning import cost as costs
from asyncflow.planning.hardware import Hardware
from asyncflow.planning.memory import RoleMemory, actor_memory, device_bytes, reference_memory, rollout_memory
from asyncflow.planning.params import ModelShape, ParamCount, PlanInputError, lora_params
from asyncflow.planning.settings import CostAssumptions, PlacementRequest, RolloutSettings, TrainSettings, Workload

__all__ = ["Candidate", "PlanInputs", "StepTimes", "candidates", "check_parallelism", "colocated", "disaggregated",
           "split_step", "tensor_parallel_sizes", "with_tensor_parallel"]


@dataclass(frozen=True)
class PlanInputs:
    shape: ModelShape
    params: ParamCount
    hardware: Hardware
    train: TrainSettings = field(default_factory=TrainSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    work: Workload = field(default_factory=Workload)
    placement: PlacementRequest = field(default_factory=PlacementRequest)
    cost: CostAssumptions = field(default_factory=CostAssumptions)


@dataclass(frozen=True)
class StepTimes:
    rollout_s: float
    train_s: float
    sync_s: float  # weight sync (disaggregated)
    switch_s: float  # idle state to host and back (colocated with offload_idle)
    step_s: float


@dataclass(frozen=True)
class Candidate:
    placement: str  # colocated | disaggregated
    tensor_parallel: int  # devices per rollout instance
    rollout_devices: int
    train_devices: int  # colocated: the same devices as the rollout's
    fsdp_size: int
    sides: dict[str, list[RoleMemory]]  # "training" / "rollout" (disaggregated) or "all" -> roles held
    side_bytes: dict[str, int]  # side -> bytes one of its devices needs
    times: StepTimes
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return all(b <= self.usable_bytes for b in self.side_bytes.values())

    @property
    def fill(self) -> float:
        """The fullest side's need over what a device offers (> 1: does not fit)."""
        return max(self.side_bytes.values()) / self.usable_bytes


def check_parallelism(shape: ModelShape, rollout: RolloutSettings, devices: int) -> None:
    """Tensor parallelism splits attention heads: the engines (vLLM) need it to divide them, and
    to divide the KV heads or be a multiple of them (each device then keeps a copy of one)."""
    tp, kv = rollout.tensor_parallel, shape.num_kv_heads
    if shape.num_heads % tp:
        raise PlanInputError(f"tensor_parallel {tp} does not divide num_attention_heads {shape.num_heads}")
    if (kv % tp) if tp <= kv else (tp % kv):
        raise PlanInputError(f"tensor_parallel {tp} neither divides num_key_value_heads {kv} nor is a multiple of it")
    if tp > devices:
        raise PlanInputError(f"tensor_parallel {tp} is more than the {devices} devices")


def tensor_parallel_sizes(x: PlanInputs) -> list[int]:
    """The sizes to try: the one asked for, or (0) every valid size within a node."""
    if x.rollout.tensor_parallel:
        check_parallelism(x.shape, x.rollout, x.hardware.count)
        return [x.rollout.tensor_parallel]
    out = []
    for tp in range(1, min(x.hardware.devices_per_node, x.hardware.count) + 1):
        try:
            check_parallelism(x.shape, replace(x.rollout, tensor_parallel=tp), x.hardware.count)
        except PlanInputError:
            continue
        out.append(tp)
    return out


def with_tensor_parallel(x: PlanInputs, tp: int) -> PlanInputs:
    return replace(x, rollout=replace(x.rollout, tensor_parallel=tp))


def _reference(x: PlanInputs, shard: int) -> list[RoleMemory]:
    """A reference model's memory; none with LoRA, whose reference is the actor's base."""
    if x.placement.reference == "none" or x.train.lora_rank:
        return []
    return [reference_memory(x.shape, x.params, x.train, shard)]


def _reference_side(x: PlanInputs) -> str:
    """Where the reference's forward pass runs: with LoRA, in the actor (adapters off)."""
    return "actor" if x.train.lora_rank and x.placement.reference != "none" else x.placement.reference


def disaggregated(x: PlanInputs, rollout_devices: int) -> Candidate | None:
    """The split with ``rollout_devices``; None when FSDP's shard size does not divide the rest."""
    train_devices = x.hardware.count - rollout_devices
    fsdp = x.train.fsdp_size or train_devices
    if train_devices < 1 or train_devices % fsdp or rollout_devices % x.rollout.tp:
        return None
    ref_side = _reference_side(x)
    training = [actor_memory(x.shape, x.params, x.train, fsdp), *(_reference(x, fsdp) if ref_side == "actor" else [])]
    rollout = [rollout_memory(x.shape, x.params, x.rollout),
               *(_reference(x, rollout_devices) if ref_side == "rollout" else [])]
    ref_s = costs.forward_seconds(x.params, x.work, x.hardware, x.cost,
                                  train_devices if ref_side == "actor" else rollout_devices)
    rollout_s = costs.rollout_seconds(x.shape, x.params, x.rollout, x.work, x.hardware, x.cost, rollout_devices)
    rollout_s += ref_s if ref_side == "rollout" else 0.0
    train_s = costs.train_seconds(x.params, x.train, x.work, x.hardware, x.cost, train_devices)
    train_s += ref_s if ref_side == "actor" else 0.0
    sync_s = costs.sync_seconds(x.params, x.rollout, x.cost, lora_params(x.shape, x.train.lora_rank))
    times = StepTimes(rollout_s, train_s, sync_s, 0.0, max(rollout_s, train_s) + sync_s)
    return Candidate("disaggregated", x.rollout.tensor_parallel, rollout_devices, train_devices, fsdp,
                     {"training": training, "rollout": rollout},
                     {"training": device_bytes(training), "rollout": device_bytes(rollout)},
                     times, x.hardware.usable_bytes)


def colocated(x: PlanInputs) -> Candidate | None:
    """Every role on every device; None when the devices do not split into whole instances
    and FSDP groups."""
    n = x.hardware.count
    fsdp = x.train.fsdp_size or n
    if n % fsdp or n % x.rollout.tp:
        return None
    actor = actor_memory(x.shape, x.params, x.train, fsdp)
    rollout = rollout_memory(x.shape, x.params, x.rollout)
    ref = _reference(x, fsdp)
    roles = [actor, rollout, *ref]
    if x.placement.offload_idle:  # one side loaded at a time; the other's state waits in host memory
        need = max(device_bytes([actor, *ref]), device_bytes([rollout]))
        # the training side's sharded weights (not the transient gather buffer), optimizer state and
        # reference weights, and the rollout's weights; the KV cache is freed, not copied
        shard_bytes = math.ceil(x.params.total * x.train.bytes_per_param()["param"] / fsdp)
        actor_shard = 0 if x.train.cpu_offload else shard_bytes  # already in host memory
        moved = actor_shard + shard_bytes * len(ref) + actor.optimizer + rollout.weights
        switch_s = 2 * moved / (x.cost.host_gbs * 1e9)  # out and back in, once per step
    else:
        need, switch_s = device_bytes(roles), 0.0
    ref_s = costs.forward_seconds(x.params, x.work, x.hardware, x.cost, n) if _reference_side(x) != "none" else 0.0
    rollout_s = costs.rollout_seconds(x.shape, x.params, x.rollout, x.work, x.hardware, x.cost, n)
    train_s = costs.train_seconds(x.params, x.train, x.work, x.hardware, x.cost, n) + ref_s
    times = StepTimes(rollout_s, train_s, 0.0, switch_s, rollout_s + train_s + switch_s)
    return Candidate("colocated", x.rollout.tensor_parallel, n, n, fsdp, {"all": roles}, {"all": need}, times,
                     x.hardware.usable_bytes)


def _for_tensor_parallel(x: PlanInputs) -> list[Candidate | None]:
    request, n = x.placement, x.hardware.count
    found = [colocated(x)] if request.mode in ("colocated", "both") else []
    if request.mode in ("disaggregated", "both"):
        if request.rollout_devices is not None:
            found.append(disaggregated(x, request.rollout_devices))
        else:
            found += [disaggregated(x, r) for r in range(split_step(x), n, split_step(x))]
    return found


def split_step(x: PlanInputs) -> int:
    """Rollout devices go in whole instances; beyond one node, in whole nodes (an instance's
    tensor parallelism stays within a node, and nodes are what a launcher hands out)."""
    per_node, tp = x.hardware.devices_per_node, x.rollout.tp
    return tp if x.hardware.count <= per_node else math.lcm(tp, per_node)


def candidates(x: PlanInputs) -> list[Candidate]:
    """Every placement the request allows, fastest fitting first, then the rest by step time."""
    sizes = tensor_parallel_sizes(x)
    kept = [c for tp in sizes for c in _for_tensor_parallel(with_tensor_parallel(x, tp)) if c is not None]
    if not kept:
        n, fixed = x.hardware.count, x.placement.rollout_devices
        what = (f"rollout_devices {fixed}: needs" if fixed is not None
                else f"no placement of {n} devices fits the request: disaggregated needs")
        raise PlanInputError(f"{what} whole rollout instances (a multiple of tensor_parallel, tried {sizes}) and at "
                             f"least one training device whose count the FSDP shard size "
                             f"({x.train.fsdp_size or 'all'}) divides, out of {n} devices; colocated needs a device "
                             "count divisible by tensor_parallel and fsdp_size")
    return sorted(kept, key=lambda c: (not c.fits, c.times.step_s, c.tensor_parallel))
