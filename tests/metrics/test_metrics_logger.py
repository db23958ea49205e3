"""MetricsLogger: JSONL rows, flushing, console line, TensorBoard (optional)."""
from __future__ import annotations

import importlib.util
import json
import logging
import sys

import pytest
import torch

from asyncflow.metrics import MetricsLogger
from asyncflow.metrics.logger import format_console_line


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_flushed_at_each_log_with_step_and_time(tmp_path):
    logger = MetricsLogger(tmp_path, console=False, tensorboard=False)
    logger.log(0, {"phase": "sft", "sft/loss": 1.5, "eval/accuracy": 0.1})
    # read through another handle before close: what a crash right now would leave
    rows = _lines(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 0, "time_s": rows[0]["time_s"], "phase": "sft", "sft/loss": 1.5,
                     "eval/accuracy": 0.1}]
    logger.log(1, {"reward/mean": torch.tensor(0.25), "async/staleness_max": torch.tensor(2)})
    rows = _lines(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    assert rows[1]["reward/mean"] == 0.25 and rows[1]["async/staleness_max"] == 2
    assert isinstance(rows[1]["async/staleness_max"], int)
    assert 0 <= rows[0]["time_s"] <= rows[1]["time_s"] < 60
    logger.close()
    logger.close()  # closing twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(2, {"reward/mean": 0.3})


def test_shared_t0_gives_time_since_the_run_started(tmp_path):
    import time
    with MetricsLogger(tmp_path, console=False, tensorboard=False, t0=time.perf_counter() - 100) as logger:
        row = logger.log(3, {"x": 1.0})
    assert 100 <= row["time_s"] < 160


def test_bad_metrics_are_refused_with_their_name(tmp_path):
    with MetricsLogger(tmp_path, console=False, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="reserved"):
            logger.log(0, {"step": 1})
        with pytest.raises(TypeError, match="'actor/loss'"):
            logger.log(0, {"actor/loss": [1.0, 2.0]})
        with pytest.raises(TypeError, match="'actor/kl'.*more than one element"):
            logger.log(0, {"actor/kl": torch.ones(3)})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_console_line_shows_key_metrics(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asyncflow.metrics"):
        with MetricsLogger(tmp_path, tensorboard=False) as logger:
            logger.log(7, {"reward/mean": 0.51234, "perf/samples_per_s": 130.0,
                           "async/staleness_mean": 0.5, "timing_s/update": 3.0})
    [record] = [r for r in caplog.records if r.name == "asyncflow.metrics"]
    assert record.levelno == logging.INFO
    msg = record.getMessage()
    assert msg.startswith("step 7 | reward 0.5123 | samples/s 130 | staleness 0.5 | ")
    assert "timing" not in msg  # only the key metrics
    assert format_console_line({"step": 1, "actor/loss": float("nan")}) == "step 1 | loss nan"


def test_no_console_line_when_disabled(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asyncflow.metrics"):
        with MetricsLogger(tmp_path, console=False, tensorboard=False) as logger:
            logger.log(1, {"reward/mean": 1.0})
    assert not [r for r in caplog.records if r.name == "asyncflow.metrics"]


def test_tensorboard_required_but_missing_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes it look not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, tensorboard=True)
    with MetricsLogger(tmp_path, console=False) as logger:  # auto: quietly without it
        assert not logger.tensorboard_enabled
        logger.log(0, {"reward/mean": 1.0})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_scalars_are_written(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        assert logger.tensorboard_enabled
        logger.log(0, {"reward/mean": 0.5, "phase": "rl"})  # the string goes to JSONL only
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert _lines(tmp_path / "metrics.jsonl")[0]["phase"] == "rl"
