"""What to change when a role does not fit: concrete values found by re-planning the memory
of that side with one setting changed at a time."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from asyncflow.planning.hardware import GIB
from asyncflow.planning.memory import actor_memory, device_bytes, reference_memory, rollout_memory
from asyncflow.planning.params import PlanInputError
from asyncflow.planning.settings import RolloutSettings, TrainSettings
from asyncflow.planning.split import Candidate, PlanInputs, check_parallelism

__all__ = ["advice"]


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest v in 1..high with fits(v) (fits is monotone: true up to some point); 0 if none."""
    low, best = 1, 0
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def _training_bytes(x: PlanInputs, c: Candidate, train: TrainSettings, shard: int) -> int:
    roles = [actor_memory(x.shape, x.params, train, shard)]
    if x.placement.reference == "actor" or (x.placement.reference != "none" and c.placement == "colocated"):
        roles.append(reference_memory(x.shape, x.params, train, shard))
    return device_bytes(roles)


def _rollout_bytes(x: PlanInputs, rollout: RolloutSettings, c: Candidate) -> int:
    roles = [rollout_memory(x.shape, x.params, rollout)]
    if x.placement.reference == "rollout" and c.placement == "disaggregated":
        roles.append(reference_memory(x.shape, x.params, x.train, c.rollout_devices))
    return device_bytes(roles)


def _training_advice(x: PlanInputs, c: Candidate, budget: int) -> list[str]:
    t, shard = x.train, c.fsdp_size
    need = _training_bytes(x, c, t, shard)
    if need <= budget:
        return []
    out = [f"training side needs {_gib(need)} per device, {_gib(need - budget)} over: change one of"]
    if not t.activation_checkpointing:
        with_ckpt = _training_bytes(x, c, replace(t, activation_checkpointing=True), shard)
        out.append(f"  --activation-checkpointing (needs {_gib(with_ckpt)})")
    tokens = _largest(lambda v: _training_bytes(x, c, replace(t, micro_batch_tokens=v), shard) <= budget,
                      t.micro_batch_tokens)
    if tokens:
        out.append(f"  --micro-batch-tokens {tokens} or less (now {t.micro_batch_tokens})")
    if not t.optimizer_offload and not t.cpu_offload:
        offloaded = _training_bytes(x, c, replace(t, optimizer_offload=True), shard)
        out.append(f"  --optimizer-offload (needs {_gib(offloaded)}; master and moments in host memory)")
    if not t.cpu_offload:
        offloaded = _training_bytes(x, c, replace(t, cpu_offload=True), shard)
        out.append(f"  --cpu-offload (needs {_gib(offloaded)}; shards, gradients and optimizer state in host "
                   "memory, the optimizer step on the host)")
    n = x.hardware.count
    # colocated: a shard size that divides the devices; disaggregated: training devices that leave
    # at least one rollout instance
    sizes = [s for s in range(shard + 1, n + 1) if n % s == 0] if c.placement == "colocated" \
        else range(shard + 1, n - x.rollout.tp + 1)
    wider = next((s for s in sizes if _training_bytes(x, c, t, s) <= budget), None)
    if wider is not None:
        out.append(f"  shard the training state over {wider} devices or more (now {shard}): "
                   + ("--fsdp-size / --devices" if c.placement == "colocated"
                      else "fewer --rollout-devices or more --devices"))
    if len(out) == 1:
        out.append("  more devices or more memory per device: no single setting above is enough")
    return out


def _rollout_advice(x: PlanInputs, c: Candidate, budget: int) -> list[str]:
    r = x.rollout
    need = _rollout_bytes(x, r, c)
    if need <= budget:
        return []
    out = [f"rollout side needs {_gib(need)} per device, {_gib(need - budget)} over: change one of"]
    rows = _largest(lambda v: _rollout_bytes(x, replace(r, max_running_rows=v), c) <= budget, r.max_running_rows)
    if rows:
        out.append(f"  --max-running-rows {rows} or less (now {r.max_running_rows})")
    context = _largest(lambda v: _rollout_bytes(x, replace(r, context_length=v), c) <= budget, r.context_length)
    if context:
        out.append(f"  --context-length {context} or less (now {r.context_length})")
    for tp in range(r.tensor_parallel + 1, min(x.hardware.count, x.hardware.devices_per_node) + 1):
        wider = replace(r, tensor_parallel=tp)
        try:
            check_parallelism(x.shape, wider, x.hardware.count)
        except PlanInputError:
            continue
        if _rollout_bytes(x, wider, c) <= budget:
            out.append(f"  --tensor-parallel {tp} (now {r.tensor_parallel})")
            break
    if len(out) == 1:
        out.append("  more memory per device: no tensor-parallel size within a node is enough")
    return out


def advice(x: PlanInputs, c: Candidate) -> list[str]:
    """Lines saying which side is over and what would make it fit; empty when it fits."""
    if c.fits:
        return []
    budget = c.usable_bytes
    out = []
    if c.placement == "colocated" and not x.placement.offload_idle:
        out.append(f"colocated devices need {_gib(c.side_bytes['all'])} with every role loaded: "
                   "--offload-idle loads one side at a time")
    out += _training_advice(x, c, budget)
    out += _rollout_advice(x, c, budget)
    return out
