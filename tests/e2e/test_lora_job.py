"""`asyncflow train grpo model.lora.rank=8` as a user runs it (built-in rollout engine, 2 CPU ranks).

RL starts from the session's warm-up (tests/e2e/conftest.py: the main job's supervised warm-up,
exported, loaded back as a user's checkpoint: the base LoRA RL starts from); RL trains the adapters:
held-out accuracy rises over RL, and every weight sync of RL moves exactly the adapters' bytes
(the ``weight_sync/bytes`` of metrics.jsonl against the exported PEFT adapter's tensors)."""
from __future__ import annotations

import json

import pytest
from _run import ok, train_as_is


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's warm-up (when this test runs first), then 120 RL steps
def test_main_job_with_lora_learns_and_syncs_only_the_adapters(tmp_path, warm_start):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    ok(train_as_is(out, "grpo", *warm_start, "model.lora.rank=8", "trainer.steps=120", "trainer.time_budget_s=0",
                   "trainer.eval_every=0", timeout=900))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 120 and summary["warmup_steps"] == 0
    before, after = summary["eval_accuracy_before_rl"], summary["eval_accuracy_after_rl"]
    assert after > before + 0.05, summary

    adapters = load_file(str(out / "hf_model_adapter" / "adapter_model.safetensors"))
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    adapter_bytes = sum(t.numel() for t in adapters.values()) * 4  # a CPU run syncs in float32
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    synced = [m for m in metrics if "weight_sync/bytes" in m]
    assert len(synced) >= 100, len(synced)  # (nearly) every RL step's version
    assert {m["weight_sync/bytes"] for m in synced} == {float(adapter_bytes)}
    assert {m["weight_sync/tensors"] for m in synced} == {float(len(adapters))}
