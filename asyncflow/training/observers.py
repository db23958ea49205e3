"""Step observers: what happens after each RL step besides training, one idea each. The
executor calls them in order (``StepObserver``): the step's metrics and progress bar, the
sample audit, the checkpoint policy, the evaluation schedule, the time budget and the stop file."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from .. import column_names as col
from ..agents.runner import render_turns
from ..metrics.logger import MetricsLogger
from ..metrics.progress import Progress
from ..transfer_queue.columns import Column, FixedColumn, JaggedColumn, ObjectColumn
from ..transfer_queue.protocol import AsyncTransferQueue
from ..workflow.executor import StepObserver, StepReport

log = logging.getLogger(__name__)


class StepMetrics(StepObserver):
    """Throughput, idle ratios, stage timings and TransferQueue occupancy per step, to the
    metrics log and the progress bar; run totals for the summary."""

    def holds_training(self, step: int) -> bool:
        return False  # it may report while the next update trains

    def __init__(self, logger: MetricsLogger, progress: Progress, tq: AsyncTransferQueue, nproc: int,
                 first_step: int):
        self.logger, self.progress, self.tq, self.nproc, self.first = logger, progress, tq, nproc, first_step
        self.start = self.last = time.monotonic()
        self.totals = {"rows": 0.0, "tokens": 0.0, "stale_sum": 0.0, "stale_max": 0.0}

    async def step_done(self, rep: StepReport) -> None:
        now = time.monotonic()
        m = dict(rep.metrics)
        dt = max(now - self.last, 1e-9)
        self.last = now
        rows, tokens = m.pop("rows", 0.0), m.pop("tokens", 0.0)
        t = self.totals
        t["rows"] += rows
        t["tokens"] += tokens
        t["stale_sum"] += m.get("async/staleness_mean", 0.0) * rows
        t["stale_max"] = max(t["stale_max"], m.get("async/staleness_max", 0.0))
        m["perf/samples_per_s"] = rows / dt
        m["perf/tokens_per_s"] = tokens / dt
        m["perf/throughput_tokens_per_s_per_device"] = tokens / dt / self.nproc
        m.update({f"timing_s/{k}": v for k, v in rep.timing.items()})
        wall = now - self.start
        for role, busy in rep.role_busy.items():
            m[f"perf/idle_ratio/{role}"] = max(0.0, 1.0 - busy / max(wall, 1e-9))
        m["step_time_s"] = rep.finished - rep.started
        # the step's partition is cleared: this must not grow
        held = rep.tq_units if rep.tq_units is not None else await self.tq.unit_stats()
        m["tq/rows_held"] = float(sum(u["rows"] for u in held))
        m["tq/bytes_held"] = float(sum(u["bytes"] for u in held))
        self.logger.log(rep.step + 1, m)
        self.progress.update(rep.step + 1 - self.first, m)

    def summary(self, rl_s: float) -> dict[str, float]:
        t = self.totals
        return {"samples_per_s": t["rows"] / max(rl_s, 1e-9), "tokens_per_s": t["tokens"] / max(rl_s, 1e-9),
                "staleness_mean": t["stale_sum"] / max(t["rows"], 1.0), "staleness_max": t["stale_max"]}


AUDIT_COLUMNS = [col.PROMPT_INDEX, col.SEED, col.RESPONSE_IDS, col.GEN_VERSION, col.SCORES, col.TOKEN_VERSIONS,
                 col.LOSS_MASK, col.EPISODE]


class SampleAudit(StepObserver):
    """samples.jsonl: which prompt, seed and policy version each trained row came from (the
    fields whose columns the recipe has)."""

    def holds_training(self, step: int) -> bool:
        return False  # it may report while the next update trains

    def __init__(self, path: Path, append: bool, columns: list[str], decode: Any = None):
        self.decode = decode  # a tokenizer: episodes (rows with a loss mask) get their text too
        audit = [*AUDIT_COLUMNS, col.PROMPT] if decode is not None else AUDIT_COLUMNS  # episodes: with their prompt
        self.reads = tuple(c for c in audit if c in set(columns))
        self.file = open(path, "a" if append else "w")

    async def trained(self, step: int, meta: Any, columns: Mapping[str, Column]) -> None:
        cols = {c: columns[c] for c in self.reads}
        lines: list[dict[str, Any]] = [{"step": step, "uid": int(meta.groups[i]) if meta.groups else -1}
                                       for i in range(len(meta))]
        for name, column in cols.items():
            key = "score" if name == col.SCORES else name
            if isinstance(column, ObjectColumn):
                for line, v in zip(lines, column.items):
                    line[key] = v
            elif isinstance(column, JaggedColumn):
                offs, vals = column.offsets.tolist(), column.values.tolist()
                for i, line in enumerate(lines):
                    line[key] = vals[offs[i]:offs[i + 1]]
            elif isinstance(column, FixedColumn):
                for line, v in zip(lines, column.data.tolist()):
                    line[key] = v
            else:
                raise TypeError(f"samples.jsonl: column {name!r} is a {type(column).__name__}, not a fixed, "
                                "jagged or object column")
        if self.decode is not None and col.LOSS_MASK in cols:
            for line in lines:
                line["text"] = render_turns(self.decode, line[col.RESPONSE_IDS], line[col.LOSS_MASK])
        for line in lines:
            self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class CheckpointPolicy(StepObserver):
    """A run checkpoint every ``every`` steps, at the data position of the step's end."""

    def __init__(self, every: int, save: Callable[[int, int, list[int]], Awaitable[Any]]):
        self.every, self.save = every, save

    async def step_done(self, rep: StepReport) -> None:
        if self.holds_training(rep.step):
            await self.save(rep.step + 1, rep.next_uid, rep.in_flight_uids)

    def holds_training(self, step: int) -> bool:
        """The weights saved must be this step's: the next update waits."""
        return bool(self.every) and (step + 1) % self.every == 0


class EvalSchedule(StepObserver):
    """A held-out evaluation every ``every`` steps, running beside training."""

    def __init__(self, every: int, evaluate: Callable[[int, str], Coroutine[Any, Any, float]]):
        self.every, self.evaluate = every, evaluate
        self.pending: list[asyncio.Task] = []

    async def step_done(self, rep: StepReport) -> None:
        if self.holds_training(rep.step):
            self.pending.append(asyncio.create_task(self.evaluate(rep.step + 1, "rl")))

    def holds_training(self, step: int) -> bool:
        """An evaluation starts from this step's weights: the next update waits for it to start."""
        return bool(self.every) and (step + 1) % self.every == 0

    async def wait(self) -> None:
        await asyncio.gather(*self.pending)


class TimeBudget(StepObserver):
    """Stop issuing steps once RL has run ``budget_s`` seconds (0: no budget)."""

    def holds_training(self, step: int) -> bool:
        return False  # it may report while the next update trains

    def __init__(self, budget_s: float, stop: Callable[[], None]):
        self.budget_s, self.stop = budget_s, stop
        self.start = time.monotonic()

    async def step_done(self, rep: StepReport) -> None:
        if self.budget_s and time.monotonic() - self.start >= self.budget_s:
            self.stop()


class StopFile(StepObserver):
    """Stop issuing steps once ``path`` exists (``trainer.stop_file``): a run ended from outside
    finishes as a time budget ends it, with its evaluation, checkpoint and export. The launcher
    refuses a file that exists before the run starts."""

    def holds_training(self, step: int) -> bool:
        return False  # it may report while the next update trains

    def __init__(self, path: Path, stop: Callable[[], None]):
        self.path, self.stop = path, stop
        self.seen = False

    async def step_done(self, rep: StepReport) -> None:
        if not self.seen and self.path.exists():
            self.seen = True
            log.info("RL stops after step %d: %s appeared (trainer.stop_file)", rep.step, self.path)
            self.stop()
