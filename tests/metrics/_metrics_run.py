"""A synthetic run directory written through the real MetricsLogger and Timeline.

It looks like an asynchronous GRPO run: rollout of step t+1 overlaps the update of step t,
the driver scores rollout chunks concurrently (overlapping spans on one lane), eval runs
every 25 steps and at the start and end, and a warm-up (sft) phase comes first.
"""
from __future__ import annotations

import math
import random
import struct
from pathlib import Path

from asyncflow.metrics import MetricsLogger, Timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails unless it starts like a real PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return w, h


LANES = ("rank0 rollout", "rank0 actor", "driver reward")


def write_run(out_dir: Path, steps: int = 300, warmup_steps: int = 5, seed: int = 0) -> tuple[int, int]:
    """Write metrics.jsonl and timeline.jsonl into out_dir; returns (metric rows, spans)."""
    rng = random.Random(seed)
    n_rows = n_spans = 0
    with MetricsLogger(out_dir, console=False, tensorboard=False) as logger, \
            Timeline(out_dir, flush_every=500) as timeline:
        for step in range(warmup_steps):
            metrics: dict[str, object] = {"phase": "sft", "sft/loss": 2.0 / (step + 1)}
            if step in (0, warmup_steps - 1):
                metrics["eval/accuracy"] = 0.05 + 0.04 * step
            logger.log(step, metrics)
            n_rows += 1
        t = 0.0
        for step in range(1, steps + 1):
            gen = 1.0 + 0.3 * rng.random()
            timeline.record("rank0 rollout", "rollout", t, t + gen, step=step, rows=64)
            for chunk in range(4):  # concurrent reward chunks: overlapping spans on one lane
                start = t + gen * (chunk + 1) / 5
                timeline.record("driver reward", "reward", start, start + 0.4, step=step, chunk=chunk)
            a = t + gen * 0.6
            for stage, dur in (("old_log_prob", 0.2), ("ref_log_prob", 0.2), ("update", 0.5)):
                timeline.record("rank0 actor", stage, a, a + dur, step=step)
                a += dur
            timeline.record("rank0 actor", "weight_sync", a, a + 0.01, step=step)
            timeline.record("rank0 rollout", "weight_sync", a, a + 0.01, step=step)
            n_spans += 10  # 1 rollout, 4 reward, 3 actor stages, 2 weight_sync
            t += gen  # the next rollout starts while the actor still updates: overlap
            metrics = {
                "reward/mean": 0.2 + 0.5 * (1 - math.exp(-step / 80)) + rng.gauss(0, 0.05),
                "perf/samples_per_s": 60 + rng.gauss(0, 5),
                "perf/tokens_per_s": 30000 + rng.gauss(0, 2000),
                "async/staleness_mean": rng.random(),
                "async/staleness_max": 1,
                "timing_s/update": 0.5,
                "perf/idle_ratio/rank0 actor": 0.2,
                "actor/loss": rng.gauss(0, 0.1),
                "phase": "rl",
            }
            if step == 1 or step % 25 == 0 or step == steps:
                metrics["eval/accuracy"] = 0.2 + 0.5 * step / steps
            logger.log(step, metrics)
            n_rows += 1
    return n_rows, n_spans
