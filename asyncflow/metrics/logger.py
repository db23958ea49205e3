"""MetricsLogger: one JSON line per training step, plus a console line, TensorBoard and W&B.

`metrics.jsonl` is the run's record that `asyncflow report` redraws from, so it is written
line-buffered and flushed on every `log`: a crash loses at most the line being written.
Each line is `{"step": int, "time_s": float, ...flat metrics}`; `time_s` counts seconds
since the run started (pass `t0=timeline.t0` so metrics and timeline share one clock).

Other backends receive the same rows' finite numbers: TensorBoard (`out_dir/tensorboard/`)
and Weights & Biases (offline by default: `out_dir/wandb/offline-run-*`, uploaded later
with `wandb sync`). Their packages are imported only when chosen.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from asyncflow.cpu_account import charged

log = logging.getLogger("asyncflow.metrics")

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "time_s")
# Backend names for MetricsLogger(backends=...). jsonl is always written: it is the run's record.
BACKENDS = ("jsonl", "tensorboard", "wandb")

# The console line shows only these, in this order, under short names: a full row is
# dozens of numbers and would drown the log.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("phase", "phase"),
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("sft/loss", "sft_loss"),
    ("actor/loss", "loss"),
    ("actor/kl_loss", "kl"),
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


def is_number(value: Any) -> TypeGuard[float]:
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


def write_scalars(writer: Any, row: Mapping[str, Any]) -> None:
    """A row's numbers to TensorBoard as one event (one summary of many values): what
    ``add_scalar`` per metric writes as one event each, with a protobuf, an API-usage log
    call and a queue hand-off per metric, every step."""
    from tensorboard.compat.proto.summary_pb2 import Summary  # lazy, as the writer itself

    values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in row.items()
              if key not in RESERVED_KEYS and is_number(value)]
    if values:
        writer._get_file_writer().add_summary(Summary(value=values), row["step"])


def _open_wandb_run(out_dir: Path, init: Mapping[str, Any] | None) -> Any:
    """A wandb run, offline under `out_dir` unless `init` (keyword arguments of wandb.init) says otherwise."""
    if importlib.util.find_spec("wandb") is None:
        raise ImportError("MetricsLogger(backends=[..., 'wandb']) needs the `wandb` package, which is not "
                          "installed: pip install wandb (or pip install -e '.[wandb]')")
    import wandb  # lazy: a second or more to import, and it starts a service process at init

    kwargs: dict[str, Any] = {"project": "asyncflow", "name": out_dir.resolve().name, "dir": str(out_dir),
                              "mode": "offline",
                              # metrics.jsonl and the log already hold everything printed; W&B's
                              # capture of stdout/stderr would wrap the streams of the whole process.
                              "settings": wandb.Settings(console="off")}
    kwargs.update(init or {})
    run = wandb.init(**kwargs)
    # Rows go in as they come (W&B's own counter) with the trainer's step as a column and every
    # chart's x axis: W&B drops a row whose step= is lower than the last, and the RL phase's
    # steps start again from 1 after the warmup's.
    run.define_metric("*", step_metric="step")
    return run


def _choose_backends(backends: Sequence[str] | None, tensorboard: bool | None) -> tuple[bool | None, bool]:
    """(tensorboard wanted: None auto / True required / False off, wandb wanted)."""
    if backends is None:  # the behaviour before backends existed
        return tensorboard, False
    if tensorboard is not None:
        raise ValueError("MetricsLogger: pass backends=[...] or tensorboard=..., not both")
    if isinstance(backends, str):
        raise TypeError(f"MetricsLogger: backends must be a list of names, got the string {backends!r}")
    names = [str(b).strip().lower() for b in backends]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"MetricsLogger: unknown backends {unknown}; expected some of {list(BACKENDS)}")
    return "tensorboard" in names, "wandb" in names


class MetricsLogger:
    """Writes `out_dir/metrics.jsonl`, and the same numbers to the chosen other backends.

    `backends`: names among "jsonl", "tensorboard", "wandb". jsonl is always written (naming
    it is optional); each other named backend is required (ImportError naming the package when
    it is not installed), and one not named is off. None (the default) keeps the behaviour
    from before this parameter: jsonl, plus TensorBoard as `tensorboard` says: None logs to it
    when the package is installed, True requires it, False never. Pass one of the two.

    `wandb_init`: keyword arguments for `wandb.init`, over the defaults project="asyncflow",
    name=<out_dir's name>, dir=out_dir, mode="offline", console capture off.

    The file is truncated at construction (one directory holds one run), unless `append` (a
    resumed run, after `keep_rows` dropped what the crash left unfinished). A resumed run is a
    new W&B run.
    """

    def __init__(self, out_dir: str | Path, *, console: bool = True,
                 tensorboard: bool | None = None, t0: float | None = None, append: bool = False,
                 backends: Sequence[str] | None = None, wandb_init: Mapping[str, Any] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.console = console
        self.t0 = time.perf_counter() if t0 is None else t0
        self._lock = threading.Lock()  # one line at a time, from any thread
        want_tensorboard, want_wandb = _choose_backends(backends, tensorboard)
        self._writer = _open_summary_writer(self.out_dir, want_tensorboard)
        self._wandb: Any | None = None
        try:
            if want_wandb:
                self._wandb = _open_wandb_run(self.out_dir, wandb_init)
        except BaseException:
            if self._writer is not None:
                self._writer.close()
            raise
        self._file = self.path.open("a" if append else "w", buffering=1, encoding="utf-8")  # line-buffered

    @property
    def backends(self) -> list[str]:
        """The backends this logger writes to."""
        return ["jsonl"] + ["tensorboard"] * (self._writer is not None) + ["wandb"] * (self._wandb is not None)

    @property
    def wandb_run(self) -> Any | None:
        """The wandb run (None when wandb is not a backend or the logger is closed)."""
        return self._wandb

    @property
    def tensorboard_enabled(self) -> bool:
        return self._writer is not None

    @charged("logging")
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
                write_scalars(self._writer, row)
            if self._wandb is not None:
                self._wandb.log({key: value for key, value in row.items() if is_number(value)})
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
            if self._wandb is not None:
                run, self._wandb = self._wandb, None
                run.finish()

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
