"""The rules that tie sections together, run once when the config loads (``check``): every
section's own ``validate()`` first, then what no one section can decide alone (ranks within
trainer.nproc, names in the registries, a placement where a feature can work)."""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES, algorithm_config_problems
from ..algorithms.registry import Registry
from ..rewards import REWARDS
from .fields import ConfigError
from .run import RunConfig


def check(cfg: RunConfig) -> RunConfig:
    """``cfg`` when every rule holds; else one ConfigError listing every problem found."""
    problems = section_problems(cfg) + cross_section_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return cfg


def section_problems(cfg: RunConfig) -> list[str]:
    """What each section's own ``validate()`` finds, in the order of the tree."""
    out: list[str] = []
    for f in fields(cfg):
        validate = getattr(getattr(cfg, f.name), "validate", None)
        if callable(validate):
            out += validate()
    return out


def cross_section_problems(cfg: RunConfig) -> list[str]:
    r, t, p = cfg.rollout, cfg.trainer, cfg.placement
    problems = []
    a = cfg.algorithm
    if a.ppo_epochs < 1 or a.ppo_mini_batch_size < 0:
        problems.append(f"algorithm.ppo_epochs must be >= 1 and algorithm.ppo_mini_batch_size >= 0 (0: the whole "
                        f"step), got {a.ppo_epochs} and {a.ppo_mini_batch_size}")
    if cfg.reward.overlong_buffer < 0 or cfg.reward.overlong_buffer > r.max_new_tokens:
        problems.append(f"reward.overlong_buffer: must lie within 0..rollout.max_new_tokens ({r.max_new_tokens}), "
                        f"got {cfg.reward.overlong_buffer}")
    if p.reward_with == "inline" and cfg.reward.model_path:
        problems.append("placement.reward_with=inline scores with the rule reward inside the rollout; a reward "
                        "model (reward.model_path) runs as its own stage: set placement.reward_with to actor "
                        "or rollout")
    if t.nproc == 1 and p.mode == "disaggregated":
        problems.append("placement.mode: trainer.nproc=1 runs every role on rank 0: set placement.mode=colocated")
    problems += _import_problems(cfg) or _registry_problems(cfg)
    problems += algorithm_config_problems(cfg.algorithm)
    if t.prompts_per_step < 1 or r.batch_prompts < 1:
        problems.append("trainer.prompts_per_step and rollout.batch_prompts must be >= 1")
    problems += _rank_problems(cfg)
    problems += _restart_problems(cfg)
    return problems


def _rank_problems(cfg: RunConfig) -> list[str]:
    """placement's ranks and devices against trainer.nproc and the rollout engine."""
    p, t, r = cfg.placement, cfg.trainer, cfg.rollout
    out = []
    if p.mode == "disaggregated" and t.nproc > 1:
        both = set(p.rollout_ranks) & set(p.actor_ranks)
        if both:
            out.append(f"placement: ranks {sorted(both)} are both actor_ranks and rollout_ranks; "
                       "use placement.mode=colocated to share ranks")
        for name in ("rollout_ranks", "actor_ranks"):
            ranks = getattr(p, name)
            bad = [x for x in ranks if not 0 <= x < t.nproc]
            if not ranks or bad:
                out.append(f"placement.{name}: {list(ranks)} must be non-empty ranks within "
                           f"0..{t.nproc - 1} (trainer.nproc={t.nproc})")
    devs = p.rollout_devices
    if devs:
        flat = [d for inst in devs for d in inst]
        if (r.engine != "vllm" or p.mode != "disaggregated" or len(devs) != len(p.rollout_ranks)
                or any(not inst for inst in devs) or len(set(flat)) != len(flat) or min(flat) < 0):
            out.append(f"placement.rollout_devices: {devs} must be one non-empty list of distinct device "
                       f"indices per rollout rank ({len(p.rollout_ranks)} here), no device in two "
                       "instances, with rollout.engine=vllm and placement.mode=disaggregated")
    return out


def _restart_problems(cfg: RunConfig) -> list[str]:
    """fault.rollout_restarts: a placement where an instance can be replaced."""
    if not cfg.fault.rollout_restarts:
        return []
    p, out = cfg.placement, []
    shared = sorted(set(p.rollout_ranks) & ({0, *p.actor_ranks}))
    if p.mode != "disaggregated" or shared:
        out.append(f"fault.rollout_restarts: needs placement.mode=disaggregated with rollout ranks apart from "
                   f"rank 0 and the training ranks (got mode {p.mode}, rollout ranks {list(p.rollout_ranks)} "
                   f"sharing {shared}): an instance is replaced by restarting its rank's process")
    if p.ref_with == "rollout":
        # the reward may (one worker per rollout rank, its lost share scored again: training/replicas.py);
        # the reference model is not made per rank
        out.append("fault.rollout_restarts: the reference model must not share the rollout ranks "
                   "(placement.ref_with=actor): a group over several rollout ranks cannot lose one")
    return out


def _import_problems(cfg: RunConfig) -> list[str]:
    """The run's ``imports`` (where user rewards, estimators and losses register), imported
    here too, so that the names they register are checked like the built-in ones."""
    out = []
    for name in cfg.imports:
        try:
            importlib.import_module(name)
        except ImportError as e:
            out.append(f"imports: cannot import {name!r}: {e}")
    return out


def _registry_problems(cfg: RunConfig) -> list[str]:
    """Names that must exist in the registries (checked at start, not at the first update)."""
    a = cfg.algorithm
    checks: list[tuple[str, Registry[Any] | Mapping[str, Any], str]] = [
        ("algorithm.advantage", ADVANTAGES, a.advantage), ("algorithm.loss_agg", AGGREGATIONS, a.loss_agg),
        ("algorithm.kl_estimator", KL_ESTIMATORS, a.kl_estimator),
        ("algorithm.value_loss", VALUE_LOSSES, a.value_loss), ("reward.name", REWARDS, cfg.reward.name)]
    if a.policy_loss != "auto":
        checks.append(("algorithm.policy_loss", POLICY_LOSSES, a.policy_loss))
    out = []
    for key, reg, name in checks:
        known = list(reg.names()) if isinstance(reg, Registry) else list(reg)  # a Registry, or REWARDS (a dict)
        if name not in known:
            out.append(f"{key}: {name!r} is not registered; known: {', '.join(sorted(known))}")
    return out
