"""Values a run derives from its config (the launcher resolves them once, into
asyncflow.resolved.ResolvedRun; the driver and the workers read them from there). The
device and thread policy behind them is the platform's (asyncflow.platform)."""
from __future__ import annotations

from ..platform import resolve_dtype, threads_per_rank
from .run import RunConfig
from .sections import OFFLOAD_IDLE


def rollout_devices(cfg: RunConfig, rank: int) -> list[int] | None:
    """The devices of the rollout instance on ``rank`` (placement.rollout_devices), or None."""
    p = cfg.placement
    if not p.rollout_devices or rank not in p.rollout_ranks:
        return None
    return list(p.rollout_devices[list(p.rollout_ranks).index(rank)])


def rollout_dtype(cfg: RunConfig, accelerator: bool) -> str:
    """The dtype the rollout engine holds its weights in, and the weights are synced in."""
    return resolve_dtype(cfg.weight_sync.dtype, accelerator)


def rank_threads(cfg: RunConfig, cpus: int | None = None) -> int:
    """torch threads per rank: ``trainer.threads``, or with 0 (auto) the node's cores shared out
    among its ranks whenever ranks compute at the same time (stream and async modes, and any
    colocated run); 0 (torch's default: every core) in sync disaggregated runs, whose stages
    take turns (asyncflow.platform.threads_per_rank)."""
    take_turns = cfg.workflow.mode == "sync" and cfg.placement.mode == "disaggregated"
    return threads_per_rank(cfg.trainer.threads, not take_turns, cfg.trainer.nproc, cpus)


def policy_loss_name(cfg: RunConfig) -> str:
    """``algorithm.policy_loss``, with auto resolved: decoupled_ppo in async mode, else ppo_clip.
    With ``algorithm.rollout_is`` set, ppo_clip in every mode: its importance weight replaces
    decoupled_ppo's own (rollout_is=token with the same cap is decoupled_ppo)."""
    if cfg.algorithm.policy_loss != "auto":
        return cfg.algorithm.policy_loss
    return "decoupled_ppo" if cfg.workflow.mode == "async" and not cfg.algorithm.rollout_is else "ppo_clip"


def offload_idle(cfg: RunConfig) -> bool:
    """Whether the idle roles of a colocated rank offload (``placement.offload_idle``)."""
    if cfg.placement.mode != "colocated":
        return False
    forced = OFFLOAD_IDLE[str(cfg.placement.offload_idle).lower()]
    return cfg.workflow.mode == "sync" if forced is None else forced
