"""build_report: redraw a run's report from its logged files.

Reads `<out_dir>/metrics.jsonl` (required) and `<out_dir>/timeline.jsonl` (optional) and
writes into `<out_dir>/report/`, a folder of its own so the run's logs and checkpoints stay
apart from what can be redrawn at any time:

    training_curves.png   reward/mean and eval/accuracy (with eval/pass@k, eval/mean@n) over steps
    throughput.png        samples/s and tokens/s over steps
    timeline.png          which worker ran which stage when
    trace.json            the same timeline for ui.perfetto.dev / chrome://tracing
    episodes.md           a few whole episodes (turns, tool output, reward) of a multi-turn
                          run, from samples.jsonl (only when its rows carry episode text)

A run that crashed may leave half a line at the end of a file; that line is skipped with
a warning. Any other bad line is an error naming the file and line number.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncflow.metrics.logger import METRICS_FILE
from asyncflow.metrics.plots import plot_throughput, plot_timeline, plot_training_curves
from asyncflow.metrics.timeline import TIMELINE_FILE, Span
from asyncflow.metrics.trace import export_chrome_trace

log = logging.getLogger("asyncflow.metrics")

REPORT_DIR = "report"


class JsonlError(ValueError):
    """A line of a JSONL file that cannot be used; the message starts with `path:line:`."""

    def __init__(self, path: Path, lineno: int, reason: str):
        super().__init__(f"{path}:{lineno}: {reason}")
        self.path = path
        self.lineno = lineno


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of `path`."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    # After the last "\n" comes "" for a complete file, or the part of a line that a
    # crash cut off: that line is the only one allowed to be broken.
    last = len(lines) if text.endswith("\n") else len(lines) - 1
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        lineno = index + 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if index == last:
                log.warning("%s:%d: skipping a truncated last line (the run was cut off "
                            "while writing it): %.60r", path, lineno, line)
                continue
            raise JsonlError(path, lineno, f"not valid JSON ({err.msg}, column {err.colno}): "
                                           f"{line[:80]!r}") from None
        if not isinstance(obj, dict):
            raise JsonlError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file, one per line; see `iter_jsonl` for bad lines."""
    return [obj for _, obj in iter_jsonl(path)]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of `metrics.jsonl`; each must carry an integer `step`."""
    rows = []
    for lineno, row in iter_jsonl(path):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise JsonlError(Path(path), lineno, f"metrics row needs an integer 'step', got {step!r}")
        rows.append(row)
    return rows


def read_spans(path: str | Path) -> list[Span]:
    """Spans of `timeline.jsonl`."""
    spans = []
    for lineno, row in iter_jsonl(path):
        try:
            spans.append(Span.from_dict(row))
        except ValueError as err:
            raise JsonlError(Path(path), lineno, str(err)) from None
    return spans


def build_report(out_dir: str | Path) -> dict[str, Path]:
    """Draw the report of the run in `out_dir` into `out_dir/report/`; returns name -> path
    for `training_curves`, `throughput`, `timeline` and `trace`.

    Raises FileNotFoundError when `out_dir` or its metrics.jsonl does not exist, and
    JsonlError for a bad line. A missing timeline.jsonl only leaves the timeline empty.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"run directory {out_dir} does not exist or is not a directory")
    metrics_path = out_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: is {out_dir} the output directory "
                                f"of a training run?")
    rows = read_metrics(metrics_path)
    timeline_path = out_dir / TIMELINE_FILE
    if timeline_path.is_file():
        spans = read_spans(timeline_path)
    else:
        log.warning("%s not found: the timeline will be empty", timeline_path)
        spans = []

    report_dir = out_dir / REPORT_DIR
    out = {
        "training_curves": plot_training_curves(rows, report_dir / "training_curves.png"),
        "throughput": plot_throughput(rows, report_dir / "throughput.png"),
        "timeline": plot_timeline(spans, report_dir / "timeline.png"),
        "trace": export_chrome_trace(spans, report_dir / "trace.json"),
    }
    episodes = write_episodes(out_dir / "samples.jsonl", report_dir / "episodes.md")
    if episodes is not None:
        out["episodes"] = episodes
    return out


def write_episodes(samples: Path, path: Path, per_step: int = 3, steps: int = 3) -> Path | None:
    """A few whole episodes of the first, a middle and the last trained step, as text;
    None when the run's rows are not episodes."""
    if not samples.is_file():
        return None
    by_step: dict[int, list[dict[str, Any]]] = {}
    for _, row in iter_jsonl(samples):
        if "text" not in row:
            return None
        by_step.setdefault(int(row.get("step", 0)), []).append(row)
    if not by_step:
        return None
    order = sorted(by_step)
    picked = sorted({order[0], order[len(order) // 2], order[-1]})[:steps]
    lines = ["# Episodes", "", "Model text as written; tool and environment text in [[...]].", ""]
    for step in picked:
        lines.append(f"## Step {step}")
        for row in by_step[step][:per_step]:
            ep = row.get("episode") or {}
            lines += ["", (f"- prompt {row.get('prompt', row.get('prompt_index'))!r}, reward {row.get('score')}, "
                           f"turns {ep.get('turns', '?')}, tool calls {ep.get('tool_calls', '?')}, "
                           f"ended by {ep.get('finish_reason', '?')}"), "", "  " + repr(row["text"])]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
