"""`asyncflow plan`: text and JSON output, exit statuses, and no heavy imports on its path."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _plan_helpers import QWEN25_7B, QWEN25_32B

from asyncflow.cli import main


@pytest.fixture
def qwen7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_7B, "architectures": ["Qwen2ForCausalLM"]}))
    return str(tmp_path)


def test_json_plan_for_qwen_7b_on_8_devices(qwen7b, capsys):
    assert main(["plan", qwen7b, "--devices", "8", "--device-memory-gb", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"]["total"] == 7_615_616_512
    assert out["model"]["kv_bytes_per_token"] == 57344
    chosen = out["chosen"]
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert chosen == fitting[0] and chosen["times_s"]["step_s"] == min(c["times_s"]["step_s"] for c in fitting)
    assert chosen["rollout_devices"] + chosen["train_devices"] == 8
    assert {c["rollout_devices"] for c in out["candidates"]} == set(range(1, 8))
    # the rollout's KV cache: 256 rows x 4096 positions x 56 KiB
    rollout = out["chosen"]["roles"]["rollout"][0]
    assert rollout["kv_cache"] == 256 * 4096 * 57344
    assert rollout["weights"] == 7_615_616_512 * 2


def test_text_plan_says_what_to_change_when_nothing_fits(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B))
    assert main(["plan", str(tmp_path), "--devices", "8", "--tensor-parallel", "1"]) == 1
    out = capsys.readouterr().out
    assert "NOTHING FITS" in out and "DOES NOT FIT" in out and "to make it fit:" in out
    assert "--tensor-parallel 8 (now 1)" in out and "--optimizer-offload" in out
    # 32.8 B x 16 bytes of training state is 122 GiB per device over 4: only offloading the optimizer fits
    assert main(["plan", str(tmp_path), "--devices", "8", "--max-running-rows", "64", "--optimizer-offload"]) == 0
    # TP 1 holds 61 GiB of weights and 64 GiB of KV cache (over); TP 2 and 4 fit and tie: the smaller is shown
    assert "fastest that fits: 4 rollout (TP 2) + 4 training (FSDP 4)" in capsys.readouterr().out


def test_placement_both_lists_colocated(qwen7b, capsys):
    assert main(["plan", qwen7b, "--placement", "both", "--json"]) == 0
    placements = {c["placement"] for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert placements == {"colocated", "disaggregated"}


@pytest.mark.parametrize("argv, words", [
    (["--devices", "0"], ["devices and devices per node: need at least 1, got 0"]),
    (["--rollout-devices", "8"], ["rollout_devices 8"]),
    (["--tensor-parallel", "3"], ["tensor_parallel 3 does not divide num_attention_heads 28"]),
    (["--train-mfu", "1.5"], ["train_mfu"]),
    (["--device-memory-gb", "0"], ["device memory", "must be > 0"]),
])
def test_bad_flags_exit_2(qwen7b, capsys, argv, words):
    assert main(["plan", qwen7b, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncflow plan: error: ")
    for word in words:
        assert word in err


def test_missing_config_key_exits_2_naming_it(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN25_7B.items() if k != "hidden_size"}))
    assert main(["plan", str(tmp_path)]) == 2
    assert "missing key(s) ['hidden_size']" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nowhere")]) == 2


def test_built_in_tiny_model_without_a_path(capsys):
    assert main(["plan", "--devices", "2"]) == 0
    assert "built-in tiny model (qwen2): 0.50 M parameters" in capsys.readouterr().out


def test_plan_imports_neither_torch_nor_transformers(qwen7b):
    code = ("import sys; from asyncflow.cli import main; rc = main(['plan', sys.argv[1], '--json']); "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert rc == 0 and not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code, qwen7b], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
