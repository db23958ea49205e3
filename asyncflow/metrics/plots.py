"""PNG plots of a run: training curves, throughput, and the worker timeline.

Figures are built with `matplotlib.figure.Figure` and drawn by the Agg canvas, never through
pyplot: no global backend switch, no GUI, and safe to call from a training process.
A metric that was never logged leaves its panel with a note instead of failing, so a
report can be drawn from a run that crashed early or logged only part of the metrics.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncflow.metrics.logger import is_number
from asyncflow.metrics.timeline import Span, as_span
from asyncflow.metrics.trace import lane_sort_key

DPI = 110
WARMUP_PHASE = "sft"

# Fixed colours for the stages the pipeline records, so a stage looks the same in every
# run's report; other stages take the remaining colours of tab20 in name order.
STAGE_COLORS: dict[str, str] = {
    "rollout": "#1f77b4",
    "reward": "#2ca02c",
    "old_log_prob": "#ff7f0e",
    "ref_log_prob": "#9467bd",
    "values": "#bcbd22",
    "advantage": "#17becf",
    "update": "#d62728",
    "weight_sync": "#8c564b",
    "eval": "#7f7f7f",
    "sft": "#e377c2",
}
_SPARE_COLORS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
                 "#c7c7c7", "#dbdb8d", "#9edae5", "#393b79", "#637939", "#8c6d31", "#843c39")


def stage_colors(stages: Iterable[str]) -> dict[str, str]:
    """A colour per stage: known stages keep theirs, others get spare colours in name order."""
    stages = set(stages)
    colors = {s: c for s, c in STAGE_COLORS.items() if s in stages}
    for i, stage in enumerate(sorted(stages - set(colors))):
        colors[stage] = _SPARE_COLORS[i % len(_SPARE_COLORS)]
    return colors


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # lazy: matplotlib is slow to import, only plotting pays for it

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Any, out_png: str | Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=DPI)  # Figure picks the Agg canvas for PNG
    return out_png


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _series(rows: Sequence[Mapping[str, Any]], key: str,
            keep: Any = None) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that hold a finite number under `key` (and pass `keep`)."""
    steps: list[float] = []
    values: list[float] = []
    for row in rows:
        value = row.get(key)
        if is_number(value) and is_number(row.get("step")) and (keep is None or keep(row)):
            steps.append(row["step"])
            values.append(value)
    return steps, values


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (shorter at the start): the trend of a noisy curve."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _curve_panel(ax: Any, rows: Sequence[Mapping[str, Any]], key: str, color: str) -> bool:
    """A per-step metric as a faint raw line plus its moving average; False if never logged."""
    steps, values = _series(rows, key)
    if not steps:
        _note(ax, f"no {key} in metrics")
        return False
    if len(values) >= 20:
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, label=key)
        window = max(2, len(values) // 25)
        ax.plot(steps, _moving_average(values, window), color=color, linewidth=1.8,
                label=f"{key} (mean of {window})")
    else:
        ax.plot(steps, values, color=color, marker="o", markersize=3, label=key)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return True


def plot_training_curves(metrics_rows: Sequence[Mapping[str, Any]], out_png: str | Path) -> Path:
    """reward/mean (top) and eval/accuracy (bottom, warm-up evals marked apart; with a sampled
    evaluation its eval/pass@k and eval/mean@n too) over steps."""
    fig = _new_figure(10, 7)
    ax_reward, ax_acc = fig.subplots(2, 1, sharex=True)
    _curve_panel(ax_reward, metrics_rows, "reward/mean", "#1f77b4")
    ax_reward.set_title("reward")

    is_warmup = lambda row: row.get("phase") == WARMUP_PHASE  # noqa: E731
    rl_steps, rl_acc = _series(metrics_rows, "eval/accuracy", lambda row: not is_warmup(row))
    wu_steps, wu_acc = _series(metrics_rows, "eval/accuracy", is_warmup)
    if rl_steps or wu_steps:
        if wu_steps:
            ax_acc.plot(wu_steps, wu_acc, color="#e377c2", marker="s", markersize=5,
                        linestyle="--", label=f"eval/accuracy, warm-up ({WARMUP_PHASE})")
        if rl_steps:
            ax_acc.plot(rl_steps, rl_acc, color="#2ca02c", marker="o", markersize=4,
                        label="eval/accuracy")
            ax_acc.annotate(f"{rl_acc[-1]:.3f}", (rl_steps[-1], rl_acc[-1]), ha="right",
                            textcoords="offset points", xytext=(-4, 6), fontsize="small")
        # the sampled evaluation (trainer.eval_samples): eval/pass@k and eval/mean@n beside greedy
        sampled = sorted({k for row in metrics_rows for k in row
                          if k.startswith(("eval/pass@", "eval/mean@")) and not is_warmup(row)})
        for key in sampled:
            steps, values = _series(metrics_rows, key, lambda row: not is_warmup(row))
            ax_acc.plot(steps, values, marker=".", markersize=4, linestyle=":", label=key)
        ax_acc.set_ylabel("eval/accuracy")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend(loc="best", fontsize="small")
    else:
        _note(ax_acc, "no eval/accuracy in metrics")
    ax_acc.set_title("evaluation")
    ax_acc.set_xlabel("step")
    if not metrics_rows:
        fig.suptitle("training curves: metrics file is empty")
    return _save(fig, out_png)


def plot_throughput(metrics_rows: Sequence[Mapping[str, Any]], out_png: str | Path) -> Path:
    """perf/samples_per_s (top) and perf/tokens_per_s (bottom) over steps."""
    fig = _new_figure(10, 6)
    ax_samples, ax_tokens = fig.subplots(2, 1, sharex=True)
    _curve_panel(ax_samples, metrics_rows, "perf/samples_per_s", "#ff7f0e")
    ax_samples.set_title("throughput")
    _curve_panel(ax_tokens, metrics_rows, "perf/tokens_per_s", "#9467bd")
    ax_tokens.set_xlabel("step")
    return _save(fig, out_png)


def pack_tracks(spans: Sequence[Span]) -> list[int]:
    """The sub-track of each span so that spans on one track never overlap (fewest tracks).

    Overlapping spans of one lane (a driver running reward of step t while ref_log_prob of
    step t+1 runs) would hide each other on a single bar; stacking them shows the overlap.
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i].start)
    free: list[tuple[float, int]] = []  # (end of the track's last span, track)
    tracks = [0] * len(spans)
    n_tracks = 0
    for i in order:
        if free and free[0][0] <= spans[i].start:
            _, track = heapq.heappop(free)
        else:
            track, n_tracks = n_tracks, n_tracks + 1
        tracks[i] = track
        heapq.heappush(free, (spans[i].end, track))
    return tracks


def busy_seconds(spans: Iterable[Span]) -> float:
    """Length of the union of the spans: time the lane was doing anything."""
    total = 0.0
    run: tuple[float, float] | None = None  # (start, end) of the union's part being extended
    for s in sorted(spans, key=lambda s: s.start):
        if run is None or s.start > run[1]:
            if run is not None:
                total += run[1] - run[0]
            run = (s.start, s.end)
        else:
            run = (run[0], max(run[1], s.end))
    if run is not None:
        total += run[1] - run[0]
    return total


def _draw_lanes(ax: Any, lanes: list[tuple[str, list[tuple[Span, int]], int]],
                colors: Mapping[str, str], window: tuple[float, float], width_px: float) -> None:
    """Draw the spans that meet `window` as bars: lane i at y = i (top-down), its tracks
    splitting the lane's height.

    This is what `broken_barh` draws, but as one PolyCollection for the whole axes: one
    collection per (lane, track, stage) made a few thousand spans take seconds.
    """
    # drawing only, beside matplotlib (heavy): `import asyncflow.cli` (the report command) loads neither
    import numpy as np
    from matplotlib.collections import PolyCollection

    lo, hi = window
    # A span shorter than a pixel would vanish; draw it one pixel wide so short stages
    # (weight_sync) stay visible. Positions are exact; only the drawn width is padded.
    min_width = (hi - lo) / width_px
    bar_height = 0.8
    verts, facecolors = [], []
    for row, (_, placed, n_tracks) in enumerate(lanes):
        h = bar_height / n_tracks
        for s, track in placed:
            if s.end < lo or s.start > hi:
                continue
            x0, x1 = s.start, s.start + max(s.duration, min_width)
            y0 = row - bar_height / 2 + track * h
            verts.append(((x0, y0), (x0, y0 + h), (x1, y0 + h), (x1, y0)))
            facecolors.append(colors[s.stage])
    # an (N, 4, 2) array takes matplotlib's vectorised path, not one Path object per bar
    bars = np.array(verts, dtype=float).reshape(-1, 4, 2)
    polys = PolyCollection(bars, facecolors=facecolors,  # type: ignore[arg-type]  # stub lacks (N, M, 2) arrays
                           linewidths=0)
    ax.add_collection(polys, autolim=False)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.grid(axis="x", alpha=0.3)


def _detail_window(spans: Sequence[Span], t_start: float, t_end: float) -> tuple[float, float] | None:
    """A window in the middle of the run holding about 60 spans, or None if the whole run is
    already that sparse. Over a long run every span is a pixel wide; the close-up is where
    the overlap of stages can actually be seen."""
    per_lane = len(spans) / max(1, len({s.lane for s in spans}))
    if per_lane <= 60:
        return None
    length = (t_end - t_start) * 60 / per_lane
    middle = (t_start + t_end) / 2
    return middle - length / 2, middle + length / 2


def plot_timeline(spans: Iterable[Span | Mapping[str, Any]], out_png: str | Path) -> Path:
    """One horizontal lane per worker, one colour per stage, x in seconds since the start.

    Overlapping spans of a lane are stacked on sub-tracks. A long run gets a second panel,
    a close-up of a short window in the middle of the run, where single steps are visible.
    Lane labels give the fraction of the run each worker was busy.
    """
    from matplotlib.patches import Patch  # heavy: matplotlib, only when drawing

    all_spans = [as_span(s) for s in spans]
    by_lane: dict[str, list[Span]] = {}
    for s in all_spans:
        by_lane.setdefault(s.lane, []).append(s)
    width = 14.0
    if not all_spans:
        fig = _new_figure(width, 2.5)
        _note(fig.subplots(), "no spans in timeline")
        return _save(fig, out_png)

    t_start = min(0.0, min(s.start for s in all_spans))
    t_end = max(s.end for s in all_spans)
    wall = max(t_end - t_start, 1e-9)
    lanes = []
    labels = []
    for lane in sorted(by_lane, key=lane_sort_key):
        tracks = pack_tracks(by_lane[lane])
        n_tracks = max(tracks) + 1
        lanes.append((lane, list(zip(by_lane[lane], tracks)), n_tracks))
        busy = busy_seconds(by_lane[lane]) / wall
        labels.append(f"{lane}  {busy:.0%}" + (f" ({n_tracks} tracks)" if n_tracks > 1 else ""))
    colors = stage_colors(s.stage for s in all_spans)
    detail = _detail_window(all_spans, t_start, t_end)
    panel_height = 0.8 + 0.5 * len(lanes)
    fig = _new_figure(width, min(40.0, 0.8 + panel_height * (2 if detail else 1)))
    axes = fig.subplots(2 if detail else 1, 1, squeeze=False)[:, 0]
    width_px = width * DPI * 0.75  # the axes take about 3/4 of the figure's width

    _draw_lanes(axes[0], lanes, colors, (t_start, t_end + wall * 0.01), width_px)
    axes[0].set_title(f"timeline: {len(all_spans)} spans on {len(lanes)} lanes over {wall:.1f} s")
    if detail:
        _draw_lanes(axes[1], lanes, colors, detail, width_px)
        axes[1].set_title(f"close-up: {detail[0]:.1f} s to {detail[1]:.1f} s")
        axes[0].axvspan(*detail, color="k", alpha=0.12, linewidth=0)  # where the close-up is
    for ax in axes:
        ax.set_yticks(range(len(lanes)), labels)
        ax.set_ylabel("worker (busy %)")
    axes[-1].set_xlabel("time since start (s)")
    handles = [Patch(facecolor=c, label=stage) for stage, c in colors.items()]
    fig.legend(handles=handles, loc="outside right upper", title="stage", fontsize="small")
    return _save(fig, out_png)
