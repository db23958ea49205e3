"""Progress bar, and that importing the package stays cheap."""
from __future__ import annotations

import io
import subprocess
import sys

from asyncflow.metrics import Progress


def test_progress_bar_shows_step_reward_throughput_and_staleness():
    out = io.StringIO()
    with Progress(10, file=out, mininterval=0) as bar:
        for step in range(1, 11):
            bar.update(step, {"reward/mean": 0.5, "perf/samples_per_s": 120.0,
                              "async/staleness_mean": 1.5, "phase": "rl"})
    text = out.getvalue()
    assert "10/10" in text
    assert "reward=0.5, samples/s=120, stale=1.5" in text


def test_disabled_progress_draws_nothing():
    bar = Progress(10, enabled=False)
    assert not bar.enabled
    bar.update(3, {"reward/mean": 1.0})
    bar.close()


def test_import_does_not_load_heavy_packages():
    code = ("import sys, asyncflow.metrics; "
            "print(sorted(m for m in ('matplotlib', 'tqdm', 'torch', 'tensorboard', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
