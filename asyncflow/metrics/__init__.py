"""Metrics of a training run: what it logs while running, and the report drawn afterwards.

While running: `MetricsLogger` (metrics.jsonl, console, TensorBoard), `Timeline`
(timeline.jsonl: which worker ran which stage when) and `Progress` (a tqdm bar).
Afterwards: `build_report(out_dir)` (also `asyncflow report <out_dir>`) draws PNGs and a
Chrome trace from those files. matplotlib, tqdm and tensorboard are imported only when
used, so importing this package is cheap.
"""
from .logger import MetricsLogger
from .progress import Progress
from .report import JsonlError, build_report, read_jsonl
from .timeline import Span, Timeline
from .trace import export_chrome_trace

__all__ = ["MetricsLogger", "Timeline", "Span", "Progress", "build_report", "read_jsonl",
           "JsonlError", "export_chrome_trace"]
