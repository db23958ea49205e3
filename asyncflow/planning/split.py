"""The placements a run could use, their memory per device and predicted step time, and the
fastest that fits.

- disaggregated (the AsyncFlow paper's async mode): rollout and training devices apart; a step
  takes max(rollout, training) + weight sync, since generation of the next step runs while the
  current one trains. Every split with whole rollout instances is a candidate.
- colocated (verl's hybrid engine): every role on every device, taking turns; a step takes
  rollout + training (+ moving the idle role's state to host and back when ``offload_idle``).
  The in-place weight update is not charged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncflow.planning import cost as costs
from asyncflow.planning.hardware import Hardware
from asyncflow.planning.memory import RoleMemory, actor_memory, device_bytes, reference_memory, rollout_memory
from asyncflow.planning.params import ModelShape, ParamCount, PlanInputError
from asyncflow.planning.settings import CostAssumptions, PlacementRequest, RolloutSettings, TrainSettings, Workload

__all__ = ["Candidate", "PlanInputs", "StepTimes", "candidates", "check_parallelism", "colocated", "disaggregated"]


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
    """Tensor parallelism splits attention heads: the engines need it to divide them."""
    tp = rollout.tensor_parallel
    if shape.num_heads % tp:
        raise PlanInputError(f"tensor_parallel {tp} does not divide num_attention_heads {shape.num_heads}")
    if tp > shape.num_kv_heads and tp % shape.num_kv_heads:
        raise PlanInputError(f"tensor_parallel {tp} is above num_key_value_heads {shape.num_kv_heads} "
                             "and not a multiple of it")
    if tp > devices:
        raise PlanInputError(f"tensor_parallel {tp} is more than the {devices} devices")


def _reference(x: PlanInputs, shard: int) -> list[RoleMemory]:
    return [reference_memory(x.shape, x.params, x.train, shard)] if x.placement.reference != "none" else []


def disaggregated(x: PlanInputs, rollout_devices: int) -> Candidate | None:
    """The split with ``rollout_devices``; None when FSDP's shard size does not divide the rest."""
    train_devices = x.hardware.count - rollout_devices
    fsdp = x.train.fsdp_size or train_devices
    if train_devices < 1 or train_devices % fsdp or rollout_devices % x.rollout.tensor_parallel:
        return None
    ref_side = x.placement.reference
    training = [actor_memory(x.shape, x.params, x.train, fsdp), *(_reference(x, fsdp) if ref_side == "actor" else [])]
    rollout = [rollout_memory(x.shape, x.params, x.rollout),
               *(_reference(x, rollout_devices) if ref_side == "rollout" else [])]
    ref_s = costs.forward_seconds(x.params, x.work, x.hardware, x.cost,
                                  train_devices if ref_side == "actor" else rollout_devices)
    rollout_s = costs.rollout_seconds(x.shape, x.params, x.rollout, x.work, x.hardware, x.cost, rollout_devices)
    rollout_s += ref_s if ref_side == "rollout" else 0.0
    train_s = costs.train_seconds(x.params, x.train, x.work, x.hardware, x.cost, train_devices)
    train_s += ref_s if ref_side == "actor" else 0.0
    sync_s = costs.sync_seconds(x.params, x.rollout, x.cost)
    times = StepTimes(rollout_s, train_s, sync_s, 0.0, max(rollout_s, train_s) + sync_s)
    return Candidate("disaggregated", rollout_devices, train_devices, fsdp,
                     {"training": training, "rollout": rollout},
                     {"training": device_bytes(training), "rollout": device_bytes(rollout)},
                     times, x.hardware.usable_bytes)


def colocated(x: PlanInputs) -> Candidate | None:
    """Every role on every device; None when the devices do not split into whole instances
    and FSDP groups."""
    n = x.hardware.count
    fsdp = x.train.fsdp_size or n
    if n % fsdp or n % x.rollout.tensor_parallel:
        return None
    actor = actor_memory(x.shape, x.params, x.train, fsdp)
    rollout = rollout_memory(x.shape, x.params, x.rollout)
    ref = _reference(x, fsdp)
    roles = [actor, rollout, *ref]
    if x.placement.offload_idle:  # one side loaded at a time; the other's state waits in host memory
        need = max(device_bytes([actor, *ref]), device_bytes([rollout]))
        moved = actor.weights + actor.optimizer + rollout.weights + sum(r.weights for r in ref)
        switch_s = 2 * moved / (x.cost.host_gbs * 1e9)  # out and back in, once per step
    else:
        need, switch_s = device_bytes(roles), 0.0
    ref_s = costs.forward_seconds(x.params, x.work, x.hardware, x.cost, n) if ref else 0.0
    rollout_s = costs.rollout_seconds(x.shape, x.params, x.rollout, x.work, x.hardware, x.cost, n)
    train_s = costs.train_seconds(x.params, x.train, x.work, x.hardware, x.cost, n) + ref_s
    times = StepTimes(rollout_s, train_s, 0.0, switch_s, rollout_s + train_s + switch_s)
    return Candidate("colocated", n, n, fsdp, {"all": roles}, {"all": need}, times, x.hardware.usable_bytes)


def candidates(x: PlanInputs) -> list[Candidate]:
    """Every placement the request allows, fastest fitting first, then the rest by step time."""
    check_parallelism(x.shape, x.rollout, x.hardware.count)
    found: list[Candidate | None] = []
    request, n, tp = x.placement, x.hardware.count, x.rollout.tensor_parallel
    if request.mode in ("colocated", "both"):
        found.append(colocated(x))
    if request.mode in ("disaggregated", "both"):
        if request.rollout_devices is not None:
            fixed = disaggregated(x, request.rollout_devices)
            if fixed is None:
                raise PlanInputError(
                    f"rollout_devices {request.rollout_devices}: needs whole rollout instances (a multiple of "
                    f"tensor_parallel {tp}) and at least one training device whose count the FSDP shard size "
                    f"({x.train.fsdp_size or 'all'}) divides, out of {n} devices")
            found.append(fixed)
        else:
            found += [disaggregated(x, r) for r in range(tp, n, tp)]
    kept = [c for c in found if c is not None]
    if not kept:
        raise PlanInputError(f"no placement of {n} devices fits the request: disaggregated needs at least "
                             f"tensor_parallel ({tp}) + 1 devices, colocated a device count divisible by "
                             f"tensor_parallel and fsdp_size")
    return sorted(kept, key=lambda c: (not c.fits, c.times.step_s))
