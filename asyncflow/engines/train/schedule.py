"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (or constant).

`lr_at` is a pure function of the step, so it is easy to test and to reason about;
`build_scheduler` wraps it in a LambdaLR whose state (last_epoch) goes into checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from asyncflow.engines.train.base import OptimConfig

__all__ = ["build_scheduler", "lr_at"]


def lr_at(step: int, cfg: OptimConfig) -> float:
    """The learning rate of optimizer step `step` (0-based).

    Warm-up: steps 0..warmup_steps-1 use lr * (step + 1) / warmup_steps, so the first
    step already learns. Then, with total_steps > 0, cosine from lr down to
    lr * min_lr_ratio, reached at step total_steps and held after it; with
    total_steps == 0, constant lr.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.total_steps <= 0:
        return cfg.lr
    decay_steps = cfg.total_steps - cfg.warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """LambdaLR applying lr_at; the optimizer's base lr must be cfg.lr."""
    return LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
