"""A plan as text for people and as a dict for ``--json``."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from asyncflow.planning.cost import train_flops_per_token
from asyncflow.planning.hardware import GIB
from asyncflow.planning.memory import CATEGORIES, kv_bytes_per_token
from asyncflow.planning.params import lora_params
from asyncflow.planning.planner import Plan
from asyncflow.planning.settings import dtype_bytes
from asyncflow.planning.split import Candidate

__all__ = ["assumptions", "plan_dict", "plan_text"]

SIDE_NAMES = {"training": "training devices", "rollout": "rollout devices", "all": "every device"}


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def assumptions(plan: Plan) -> list[str]:
    x = plan.inputs
    c, hw = x.cost, x.hardware
    lines = [(f"device: {hw.name}, {hw.memory_gib:g} GiB, {hw.peak_tflops:g} TFLOP/s dense bf16, "
              f"{hw.bandwidth_tbs:g} TB/s; {hw.reserved_gib:g} GiB reserved per device for the runtime")]
    if c.train_tokens_per_s is None:
        lines.append(f"training: {train_flops_per_token(x.params, x.train) / x.params.matmul:g} x "
                     f"{_billions(x.params.matmul)} FLOPs per trained token at {c.train_mfu:g} MFU")
    else:
        lines.append(f"training: {c.train_tokens_per_s:g} trained tokens/s per device (given)")
    if c.rollout_tokens_per_s is None:
        lines.append(f"generation: decode memory-bound at {c.bandwidth_efficiency:g} of peak bandwidth or "
                     f"compute-bound at {c.train_mfu:g} MFU; prefill at {c.train_mfu:g} MFU; no long-tail")
    else:
        lines.append(f"generation: {c.rollout_tokens_per_s:g} generated tokens/s per device (given)")
    lines.append(f"weight sync {c.sync_gbs:g} GB/s; colocated host offload {c.host_gbs:g} GB/s per device")
    return lines


def _role_rows(c: Candidate) -> list[str]:
    rows = [f"  {'side':<18}{'role':<11}" + "".join(f"{k:>13}" for k in CATEGORIES) + f"{'host':>9}"]
    for side, roles in c.sides.items():
        for role in roles:
            rows.append(f"  {SIDE_NAMES[side]:<18}{role.role:<11}"
                        + "".join(f"{_g(getattr(role, k)):>13}" for k in CATEGORIES) + f"{_g(role.host):>9}")
    for side, need in c.side_bytes.items():
        verdict = "fits" if need <= c.usable_bytes else "DOES NOT FIT"
        rows.append(f"  {SIDE_NAMES[side]}: {_g(need)} GiB of {_g(c.usable_bytes)} usable -> {verdict}")
    return rows


def _label(c: Candidate) -> str:
    if c.placement == "colocated":
        return f"colocated on {c.train_devices} (TP {c.tensor_parallel}, FSDP {c.fsdp_size})"
    return f"{c.rollout_devices} rollout (TP {c.tensor_parallel}) + {c.train_devices} training (FSDP {c.fsdp_size})"


def _times(c: Candidate) -> str:
    t = c.times
    extra = f"sync {t.sync_s:.1f} s" if c.placement == "disaggregated" else f"offload {t.switch_s:.1f} s"
    join = "max(rollout, training) + sync" if c.placement == "disaggregated" else "rollout + training + offload"
    return (f"rollout {t.rollout_s:.1f} s, training {t.train_s:.1f} s, {extra} -> {t.step_s:.1f} s per step "
            f"({join})")


def plan_text(plan: Plan, top: int = 10) -> str:
    x = plan.inputs
    p, s, w = x.params, x.shape, x.work
    lines = [(f"model: {plan.source} ({s.model_type}): {_billions(p.total)} parameters "
              f"(embedding {_billions(p.embedding)}, lm_head {_billions(p.lm_head) if p.lm_head else 'tied'}, "
              f"{p.num_layers} layers x {_billions(p.per_layer)})"),
             (f"  KV cache {kv_bytes_per_token(s, x.rollout.dtype) / 1024:.1f} KiB per token "
              f"({s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} x 2 x {x.rollout.dtype})"),
             (f"devices: {x.hardware.count} x {x.hardware.memory_gib:g} GiB; step: {w.samples} samples "
              f"({w.prompts_per_step} prompts x {w.responses_per_prompt}), {w.prompt_tokens} + {w.response_tokens} "
              f"tokens each"), ""]
    if x.train.lora_rank:
        n = lora_params(s, x.train.lora_rank)
        elem = dtype_bytes(x.rollout.dtype, 'rollout dtype')
        lines.insert(-1, f"LoRA rank {x.train.lora_rank} on every linear layer: {_billions(n)} trained parameters "
                         f"({100 * n / p.total:.2f}%); weight sync {n * elem / 2**20:.0f} "
                         f"MiB per version (the whole model: {p.total * elem / 2**30:.1f} GiB); "
                         "no reference model")
    shown = plan.shown
    if plan.chosen:
        lines.append(f"fastest that fits: {_label(shown)}")
    else:
        lines.append(f"NOTHING FITS; nearest to fitting: {_label(shown)}")
    lines.append(f"  {_times(shown)}")
    lines.append("")
    lines.append("memory per device (GiB):")
    lines += _role_rows(shown)
    if plan.advice:
        lines += ["", "to make it fit:", *(f"  {a}" for a in plan.advice)]
    fitting = sum(c.fits for c in plan.candidates)
    lines += ["", f"candidates ({len(plan.candidates)}, {fitting} fit; fastest first"
                  + (f", first {top} shown" if len(plan.candidates) > top else "") + "):",
              (f"  {'placement':<44}{'rollout s':>10}{'train s':>9}{'sync/offl s':>12}{'step s':>8}"
               f"{'max GiB':>9}  fits")]
    for c in plan.candidates[:top]:
        t = c.times
        lines.append(f"  {_label(c):<44}{t.rollout_s:>10.1f}{t.train_s:>9.1f}{t.sync_s + t.switch_s:>12.1f}"
                     f"{t.step_s:>8.1f}{_g(max(c.side_bytes.values())):>9}  {'yes' if c.fits else 'no'}")
    lines += ["", "assumptions (override with flags; see docs/plan.md):", *(f"  {a}" for a in assumptions(plan))]
    return "\n".join(lines)


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    return {"placement": c.placement, "tensor_parallel": c.tensor_parallel, "rollout_devices": c.rollout_devices,
            "train_devices": c.train_devices,
            "fsdp_size": c.fsdp_size, "fits": c.fits, "times_s": asdict(c.times),
            "bytes_per_device": dict(c.side_bytes), "usable_bytes": c.usable_bytes,
            "roles": {side: [{**asdict(r), "total": r.total} for r in roles] for side, roles in c.sides.items()}}


def plan_dict(plan: Plan) -> dict[str, Any]:
    x = plan.inputs
    return {
        "model": {"source": plan.source, "model_type": x.shape.model_type,
                  "params": {**asdict(x.params), "total": x.params.total},
                  "kv_bytes_per_token": kv_bytes_per_token(x.shape, x.rollout.dtype)},
        "hardware": asdict(x.hardware), "train": asdict(x.train), "rollout": asdict(x.rollout),
        "workload": asdict(x.work), "placement": asdict(x.placement), "cost": asdict(x.cost),
        "chosen": _candidate_dict(plan.chosen) if plan.chosen else None,
        "candidates": [_candidate_dict(c) for c in plan.candidates],
        "advice": plan.advice, "assumptions": assumptions(plan),
    }
