"""MetricsLogger: one JSON line per training step, plus a console line and TensorBoard.

`metrics.jsonl` is the run's record that `asyncflow report` redraws from, so it is written
line-buffered and flushed on every `log`: a crash loses at most the line being written.
Each line is `{"step": int, "time_s": float, ...flat metrics}`; `time_s` counts seconds
since the run started (pass `t0=timeline.t0` so metrics and timeline share one clock).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncflow.metrics")

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "time_s")

# The console line shows only these, in this order, under short names: a full row is
# dozens of numbers and would drown the log.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("phase", "phase"),
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("sft/loss", "sft_loss"),
    ("actor/loss", "loss"),
    ("actor/kl", "kl"),
    ("perf/samples_per_s", "samples/s"),
    ("async/staleness_mean", "staleness"),
)


def to_plain(key: str, value: Any) -> Any:
    """A JSON-ready scalar for `value`: tensors and numpy scalars become Python numbers.

    Lists, dicts and other objects are refused: rows stay flat so that every tool
    (report, TensorBoard, jq) can read any column without knowing its shape.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)  # torch.Tensor, numpy scalar or 1-element array
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"metric {key!r}: expected a scalar, got {type(value).__name__} "
                            f"with more than one element") from err
    raise TypeError(f"metric {key!r}: expected a number, string, bool or None, "
                    f"got {type(value).__name__}")


def is_number(value: Any) -> bool:
    """True for real, finite numbers; bools and strings are not plotted or sent to TensorBoard."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _open_summary_writer(out_dir: Path, wanted: bool | None) -> Any | None:
    """A TensorBoard SummaryWriter, or None when not wanted or (auto) not installed."""
    if wanted is False:
        return None
    if importlib.util.find_spec("tensorboard") is None:  # cheap check: no torch import
        if wanted:
            raise ImportError("MetricsLogger(tensorboard=True) needs the `tensorboard` package, "
                              "which is not installed: pip install tensorboard")
        return None
    from torch.utils.tensorboard import SummaryWriter  # lazy: imports torch and tensorboard

    return SummaryWriter(log_dir=str(out_dir / TENSORBOARD_DIR))


class MetricsLogger:
    """Writes `out_dir/metrics.jsonl` (and TensorBoard scalars under `out_dir/tensorboard/`).

    `tensorboard`: None logs to TensorBoard when the package is installed, True requires it,
    False never. The file is truncated at construction (one directory holds one run), unless
    `append` (a resumed run, after `keep_rows` dropped what the crash left unfinished).
    """

    def __init__(self, out_dir: str | Path, *, console: bool = True,
                 tensorboard: bool | None = None, t0: float | None = None, append: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.console = console
        self.t0 = time.perf_counter() if t0 is None else t0
        self._lock = threading.Lock()  # one line at a time, from any thread
        self._writer = _open_summary_writer(self.out_dir, tensorboard)
        self._file = self.path.open("a" if append else "w", buffering=1, encoding="utf-8")  # line-buffered

    @property
    def tensorboard_enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one row for `step`; returns the row as written."""
        clash = [k for k in RESERVED_KEYS if k in metrics]
        if clash:
            raise ValueError(f"MetricsLogger.log(step={step}): metric names {clash} are reserved")
        row: dict[str, Any] = {"step": int(step), "time_s": round(time.perf_counter() - self.t0, 3)}
        for key, value in metrics.items():
            row[str(key)] = to_plain(str(key), value)
        line = json.dumps(row)  # NaN is kept as NaN: a diverged loss should be visible
        with self._lock:
            if self._file.closed:
                raise RuntimeError(f"MetricsLogger for {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()
            if self._writer is not None:
                for key, value in row.items():
                    if key not in RESERVED_KEYS and is_number(value):
                        self._writer.add_scalar(key, value, row["step"])
        if self.console:
            log.info(format_console_line(row))
        return row

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def keep_rows(path: str | Path, keep: Any) -> float:
    """Rewrite a JSON-lines file with only the rows ``keep(row)`` accepts (a resumed run drops
    what came after its checkpoint); returns the largest ``time_s`` kept (0 if none)."""
    path = Path(path)
    if not path.is_file():
        return 0.0
    kept, last = [], 0.0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by the crash
        if keep(row):
            kept.append(line)
            last = max(last, float(row.get("time_s", 0.0)))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    tmp.replace(path)
    return last


def format_console_line(row: Mapping[str, Any]) -> str:
    """`step 12 | reward 0.512 | samples/s 130 | ... | 41.2s`: the row's key metrics."""
    parts = [f"step {row['step']}"]
    for key, short in CONSOLE_KEYS:
        value = row.get(key)
        if isinstance(value, str):
            parts.append(f"{short} {value}")
        elif is_number(value) or isinstance(value, float):  # show NaN/inf too
            parts.append(f"{short} {value:.4g}")
    if "time_s" in row:
        parts.append(f"{row['time_s']:.1f}s")
    return " | ".join(parts)
