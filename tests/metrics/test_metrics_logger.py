"""MetricsLogger: JSONL rows, flushing, console line, backends: TensorBoard and W&B (offline)."""
from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
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


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_gets_every_number_of_a_row_in_one_event_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"reward/mean": 0.5, "phase": "rl", "actor/loss": 2, "flag": True})
        logger.log(2, {"reward/mean": 0.75, "actor/loss": float("nan")})  # NaN: not sent
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["actor/loss", "reward/mean"]  # no strings, bools, step, time_s
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("actor/loss")] == [(1, 2.0)]
    # one event per row: both metrics of step 1 share its wall time
    assert acc.Scalars("reward/mean")[0].wall_time == acc.Scalars("actor/loss")[0].wall_time


def test_default_backends_are_jsonl_and_tensorboard_when_installed(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        tb = importlib.util.find_spec("tensorboard") is not None
        assert logger.backends == ["jsonl", "tensorboard"] if tb else ["jsonl"]
        assert logger.wandb_run is None


def test_backends_list_turns_off_what_it_does_not_name(tmp_path):
    with MetricsLogger(tmp_path, console=False, backends=["jsonl"]) as logger:
        assert logger.backends == ["jsonl"] and not logger.tensorboard_enabled
        logger.log(0, {"reward/mean": 1.0})
    with MetricsLogger(tmp_path / "b", console=False, backends=[]) as logger:  # jsonl is always written
        assert logger.backends == ["jsonl"]
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"backends": ["jsonl", "mlflow"]}, ValueError, r"unknown backends \['mlflow'\]"),
    ({"backends": ["jsonl"], "tensorboard": True}, ValueError, "not both"),
    ({"backends": "wandb"}, TypeError, "list of names"),
])
def test_bad_backends_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        MetricsLogger(tmp_path, console=False, **kwargs)


def test_wandb_chosen_but_missing_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes it look not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, console=False, backends=["jsonl", "wandb"])


def test_wandb_is_imported_only_when_chosen(tmp_path):
    code = ("import sys\nfrom asyncflow.metrics import MetricsLogger\n"
            f"with MetricsLogger({str(tmp_path)!r}, console=False, backends=['jsonl']) as lg:\n"
            "    lg.log(0, {'x': 1.0})\n"
            "print('wandb' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("backends", [["tensorboard"], ["jsonl", "TensorBoard"]])
def test_tensorboard_named_is_required(tmp_path, monkeypatch, backends):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, console=False, backends=backends)


@pytest.fixture
def wandb_offline_env(tmp_path, monkeypatch):
    """wandb with no account, no network and nothing written outside tmp_path."""
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME",
                "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    for var, sub in (("WANDB_CONFIG_DIR", "wb_config"), ("WANDB_CACHE_DIR", "wb_cache"), ("WANDB_DATA_DIR", "wb_data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # anything wandb wrote to the working directory would show up here
    return tmp_path


def _wandb_record(out, keys, timeout_s=30.0):
    """The bytes of the offline run's transaction log (run-<id>.wandb) once it holds `keys`.
    run.finish() returns while wandb-core may still be flushing the file (a few ms here; at the
    latest when the process exits), so this waits for it."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        records = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(records) <= 1, records
        data = records[0].read_bytes() if records else b""
        if all(k in data for k in keys) or time.monotonic() > deadline:
            return records[0] if records else None, data
        time.sleep(0.05)


def test_wandb_offline_run_writes_its_run_files_under_out_dir(wandb_offline_env):
    out = wandb_offline_env / "run"
    with MetricsLogger(out, console=False, backends=["jsonl", "wandb"]) as logger:
        assert logger.backends == ["jsonl", "wandb"]
        run = logger.wandb_run
        assert run is not None and run.settings.mode == "offline"
        # warmup steps, then RL steps counting from 1 again: W&B must keep them all
        for step in (5, 10):
            logger.log(step, {"sft/loss": 1.0 / step, "phase": "sft"})
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": 0.25 * step, "actor/kl": torch.tensor(0.01), "phase": "rl",
                              "actor/loss": float("nan")})
    assert logger.wandb_run is None
    keys = (b"sft/loss", b"reward/mean", b"actor/kl", b"step", b"time_s")
    record, data = _wandb_record(out, keys)
    assert record is not None and record.parent.parent == out / "wandb"
    for key in keys:  # protobuf stores the metric names as plain bytes
        assert key in data, key
    assert (record.parent / "logs").is_dir()
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [5, 10, 1, 2, 3]
    assert not (wandb_offline_env / "wandb").exists()  # nothing in the working directory


def test_wandb_init_arguments_override_the_defaults(wandb_offline_env):
    out = wandb_offline_env / "run2"
    with MetricsLogger(out, console=False, backends=["wandb"],
                       wandb_init={"project": "mine", "name": "trial-7", "config": {"lr": 1e-6}}) as logger:
        run = logger.wandb_run
        assert (run.project, run.name, run.config["lr"]) == ("mine", "trial-7", 1e-6)
        logger.log(1, {"reward/mean": 0.5})
    record, data = _wandb_record(out, [b"reward/mean", b"trial-7"])
    assert b"reward/mean" in data and b"trial-7" in data
