"""Progress: a tqdm bar over training steps that shows reward, samples/s and staleness."""
from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from asyncflow.metrics.logger import is_number

# What the bar shows after the step count, under short names (one line must stay short).
POSTFIX_KEYS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("perf/samples_per_s", "samples/s"),
    ("async/staleness_mean", "stale"),
)


class Progress:
    """`update(step, metrics)` after each step; `step` is the step just finished, counted from 1,
    so the bar is full at `step == total_steps` (None: a counter with a rate, for runs that end
    on a time budget). `enabled=False` draws nothing (and never
    imports tqdm), for non-zero ranks or quiet runs. `mininterval` limits redraws, so calling
    `update` every step costs next to nothing."""

    def __init__(self, total_steps: int | None, enabled: bool = True, *,
                 mininterval: float = 0.5, file: IO[str] | None = None, desc: str = "train"):
        self.total_steps = total_steps
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm  # lazy: keeps `import asyncflow.metrics` fast

            self._bar = tqdm(total=total_steps, desc=desc, unit="step", mininterval=mininterval,
                             dynamic_ncols=True, file=file)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if self._bar is None:
            return
        if metrics:
            postfix = [f"{short}={metrics[key]:.3g}" for key, short in POSTFIX_KEYS
                       if is_number(metrics.get(key))]
            self._bar.set_postfix_str(", ".join(postfix), refresh=False)  # drawn by update below
        self._bar.update(step - self._bar.n)  # absolute position: tolerates skipped calls

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
