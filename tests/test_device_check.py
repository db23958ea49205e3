"""scripts/device_check.py's own logic, on the CPU: the mode pairs' ratios, and the `scale`
check (the training engine's settings and the built-in engine's tokens/s) on a tiny model."""
from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(root: Path, name: str, mode: str, samples_per_s: float) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"workflow": {"mode": mode}}))
    (d / "summary.json").write_text(json.dumps({"rl_steps": 20, "rl_s": 10.0, "samples_per_s": samples_per_s,
                                                "tokens_per_s": 64 * samples_per_s}))
    return d


def test_modes_gives_each_pair_its_ratio(device_check, tmp_path, capsys):
    runs = [_run(tmp_path, "s1", "sync", 100.0), _run(tmp_path, "a1", "async", 150.0),
            _run(tmp_path, "s2", "sync", 120.0), _run(tmp_path, "a2", "async", 150.0)]
    assert device_check.main(["modes", *map(str, runs)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ratio_async_vs_sync_samples_per_s"] == pytest.approx([1.5, 1.25])
    assert [r["mode"] for r in out["modes"]] == ["sync", "async", "sync", "async"] and out["missing"] == []


def test_modes_fails_on_a_run_that_did_not_finish(device_check, tmp_path, capsys):
    done = _run(tmp_path, "s1", "sync", 100.0)
    (tmp_path / "a1").mkdir()
    assert device_check.main(["modes", str(done), str(tmp_path / "a1")]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["missing"] == [str(tmp_path / "a1")]


def test_scale_runs_every_setting_on_the_cpu(device_check, tmp_path, capsys, monkeypatch):
    with socket.socket() as sock:  # a free port for the one-rank group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    model = tmp_path / "model"
    assert device_check.main(["build-model", str(model), "--spec", "64,2,2,1,128"]) == 0
    capsys.readouterr()
    rc = device_check.main(["scale", str(model), "--platform", "cpu", "--rows", "6", "--steps", "1",
                            "--micro-batch-tokens", "512", "--gen-rows", "8", "--gen-tokens", "6"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["problems"] == []
    report = out["scale"]
    assert report["loaded_vs_safetensors_max_diff"] == 0.0
    for name in ("fp32_padded", "fp32_packed", "bf16_padded", "bf16_packed", "bf16_packed_ac"):
        assert report[name]["train_tokens_per_s"] > 0
    assert report["fp32_packed"]["log_prob_max_diff_vs_fp32_padded"] <= 1e-4
    assert report["rollout_running_8"]["tokens"] == 8 * 6 and report["rollout_running_2"]["tokens"] == 8 * 6
