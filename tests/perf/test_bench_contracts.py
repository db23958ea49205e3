"""The TransferQueue and RPC benchmarks run end to end and print what their issues ask of
them: a last line that is one JSON object with the named figures, consistent ratios, and
(for the TQ bench) every method's bytes arriving intact. Speeds are not asserted here:
they are the benches' output, not a test's."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _last_json(args: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{args[0]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    last = r.stdout.strip().splitlines()[-1]
    return json.loads(last)


def _positive(out: dict, keys: list[str]) -> None:
    for k in keys:
        assert k in out, f"{k} missing from the last line: {sorted(out)}"
        assert isinstance(out[k], (int, float)) and math.isfinite(out[k]) and out[k] > 0, (k, out[k])


@pytest.mark.slow
def test_transfer_queue_bench_quick_prints_its_figures_and_moves_every_byte_intact():
    out = _last_json(["perf/bench_transfer_queue.py", "--quick"], timeout=240)
    _positive(out, ["tq_gbps", "raw_gbps", "pickle_gbps", "ratio_tq_vs_raw", "ratio_tq_vs_pickle",
                    "get_meta_p50_us_10k", "get_meta_p50_us_1m", "get_meta_p99_us_16_clients"])
    assert out["all_intact"] is True
    assert out["ratio_tq_vs_raw"] == pytest.approx(out["tq_gbps"] / out["raw_gbps"], rel=2e-3)
    assert out["ratio_tq_vs_pickle"] == pytest.approx(out["tq_gbps"] / out["pickle_gbps"], rel=2e-3)
    cpu = out["cpu_ms_per_payload"]  # read from /proc: the tests run on Linux
    _positive(cpu, ["raw", "pickle", "tq", "transport"])
    assert out["ratio_cpu_raw_vs_tq"] == pytest.approx(cpu["raw"] / cpu["tq"], rel=1e-2)
    # TQ's transport alone, beside it: what of TQ's gap is its logic rather than its RPC layer
    _positive(out, ["transport_gbps", "ratio_transport_vs_raw", "ratio_cpu_transport_vs_tq"])
    assert out["ratio_transport_vs_raw"] == pytest.approx(out["transport_gbps"] / out["raw_gbps"], rel=2e-3)
    assert out["ratio_cpu_transport_vs_tq"] == pytest.approx(cpu["transport"] / cpu["tq"], rel=1e-2)


@pytest.mark.slow
def test_rpc_bench_prints_ours_against_torch_rpc():
    out = _last_json(["perf/bench_rpc.py", "--quick", "--calls", "40", "--blocks", "4"], timeout=240)
    _positive(out, ["rpc_p50_us", "torch_rpc_p50_us", "ratio_torch_rpc_vs_ours", "rpc_4w_p50_us",
                    "torch_rpc_4w_p50_us"])
    assert out["calls"] == 40 and out["interleaved"] is True
    assert out["ratio_torch_rpc_vs_ours"] == pytest.approx(out["torch_rpc_p50_us"] / out["rpc_p50_us"], rel=0.02)


@pytest.mark.slow
def test_weight_sync_bench_lora_sends_the_adapters_alone():
    """The run-level check of LoRA's sync: with the trainer's engine on 2 FSDP ranks and the
    actor's choice of tensors, a version after the first is exactly the adapters' bytes; the
    merged version (vLLM) is as large as full fine-tuning's."""
    out = _last_json(["perf/bench_weight_sync.py", "--lora", "8", "--mb", "16", "--rounds", "2",
                      "--train-steps", "1"], timeout=600)
    full, lora = out["full"], out["lora"]
    assert out["adapters_equal_adapter_bytes"] is True
    assert lora["adapters"]["bytes_per_version"] == lora["adapter_bytes"]
    assert lora["merged"]["bytes_per_version"] == full["full"]["bytes_per_version"]
    assert lora["adapters"]["first_version_bytes"] == full["full"]["bytes_per_version"] + lora["adapter_bytes"]
    assert out["ratio_bytes_full_vs_lora"] > 10
    _positive(out, ["trainer_peak_mb_full", "trainer_peak_mb_lora", "ratio_sync_s_full_vs_lora"])


@pytest.mark.parametrize("separate", [False, True])
def test_the_tq_step_bench_replays_a_step_and_reports_its_cpu(separate):
    args = ["perf/bench_tq_step.py", "--steps", "20", "--warmup", "3", "--rows", "16"]
    out = _last_json(args + (["--separate-create"] if separate else []), timeout=120)
    assert out["requests_per_step"] == (12 if separate else 11)  # the create rides on the put unless separate
    assert out["rows"] == 16 and out["steps"] == 20 and out["separate_create"] is separate
    _positive(out, ["client_cpu_ms_per_step", "service_cpu_ms_per_step", "wall_ms_per_step"])


def test_the_tq_step_bench_refuses_rows_that_are_not_whole_groups():
    r = subprocess.run([sys.executable, "perf/bench_tq_step.py", "--rows", "10"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "--rows must be a positive multiple of 4" in r.stderr
