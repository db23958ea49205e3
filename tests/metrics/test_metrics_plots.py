"""Plot helpers: track packing, busy time, colours, and plots of partial metrics."""
from __future__ import annotations

import random

from _metrics_run import png_size

from asyncflow.metrics import Span
from asyncflow.metrics.plots import (
    STAGE_COLORS,
    busy_seconds,
    pack_tracks,
    plot_timeline,
    plot_training_curves,
    stage_colors,
)


def test_pack_tracks_never_overlaps_and_uses_the_fewest_tracks():
    rng = random.Random(1)
    spans = []
    for _ in range(300):
        start = rng.uniform(0, 100)
        spans.append(Span("driver", "reward", start, start + rng.uniform(0, 5)))
    tracks = pack_tracks(spans)
    for track in set(tracks):
        on_track = sorted((s for s, t in zip(spans, tracks) if t == track), key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(on_track, on_track[1:]))
    # the fewest tracks possible is the largest number of spans alive at one instant
    max_alive = max(sum(1 for s in spans if s.start <= p.start < s.end) for p in spans)
    assert max(tracks) + 1 == max_alive
    back_to_back = [Span("a", "s", 0, 1), Span("a", "s", 1, 2)]
    assert pack_tracks(back_to_back) == [0, 0]


def test_busy_seconds_is_the_union():
    spans = [Span("a", "s", 0, 2), Span("a", "t", 1, 3), Span("a", "s", 5, 6), Span("a", "s", 5.5, 5.7)]
    assert busy_seconds(spans) == 4.0
    assert busy_seconds([]) == 0.0


def test_stage_colors_are_stable():
    colors = stage_colors(["zeta", "update", "alpha", "rollout"])
    assert colors["update"] == STAGE_COLORS["update"] and colors["rollout"] == STAGE_COLORS["rollout"]
    assert colors == stage_colors(["alpha", "rollout", "zeta", "update"])
    assert len(set(colors.values())) == 4


def test_plots_of_partial_metrics_do_not_fail(tmp_path):
    only_warmup = [{"step": i, "phase": "sft", "sft/loss": 1.0, "eval/accuracy": 0.1 * i} for i in range(3)]
    png_size(plot_training_curves(only_warmup, tmp_path / "a.png"))  # no reward: a note instead
    png_size(plot_training_curves([{"step": 1, "reward/mean": float("nan"), "phase": "rl"}],
                                  tmp_path / "b.png"))


def test_timeline_of_many_spans_on_many_lanes(tmp_path):
    rng = random.Random(0)
    spans = []
    for lane in range(16):
        t = 0.0
        for _ in range(500):
            d = rng.uniform(0.01, 1)
            spans.append({"lane": f"rank{lane} actor", "stage": rng.choice(["update", "ref_log_prob", "x"]),
                          "start": t, "end": t + d})
            t += d * rng.uniform(0.5, 1.5)  # some overlap within a lane
    width, height = png_size(plot_timeline(spans, tmp_path / "t.png"))
    assert width > 1000 and height > 1000


def test_the_evaluation_panel_draws_the_sampled_figures(tmp_path, monkeypatch):
    import asyncflow.metrics.plots as plots
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: (figures.append(fig), save(fig, out))[1])
    rows = [{"step": s, "phase": p, "eval/accuracy": 0.1 * s, "eval/pass@1": 0.05 * s, "eval/pass@4": 0.2 * s,
             "eval/mean@4": 0.06 * s} for s, p in [(0, "before_rl"), (2, "rl"), (4, "after_rl")]]
    rows.append({"step": 1, "phase": "sft", "eval/accuracy": 0.01})
    png_size(plot_training_curves(rows, tmp_path / "c.png"))
    labels = [t.get_text() for t in figures[0].axes[1].get_legend().get_texts()]
    assert labels == ["eval/accuracy, warm-up (sft)", "eval/accuracy", "eval/mean@4", "eval/pass@1", "eval/pass@4"]
