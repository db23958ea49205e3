"""End to end: `asyncflow train` on 2 CPU ranks in a reduced form (few steps, tiny sizes).

The full 10-minute default run is the benchmark (README); here the same pipeline runs
warm-up, RL through the TransferQueue and the worker groups, evaluation, checkpoint,
Hugging Face export and the report, and the files are checked.
"""
from __future__ import annotations

import json

import pytest
from _run import ok, train


@pytest.mark.slow
@pytest.mark.both_stacks
def test_default_pipeline_end_to_end(tmp_path):
    out = tmp_path / "run"
    ok(train(out, "grpo", "trainer.steps=3", "trainer.eval_every=2", "reward.name=digits"))
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_accuracy_before_rl", "eval_accuracy_after_rl", "wall_s", "samples_per_s", "tokens_per_s"):
        assert key in summary, key
    assert summary["rl_steps"] == 3 and summary["samples_per_s"] > 0
    assert summary["staleness_max"] <= 1
    for name in ("training_curves.png", "throughput.png", "timeline.png", "trace.json"):
        f = out / "report" / name
        assert f.is_file() and f.stat().st_size > 100, name
    trace = json.loads((out / "report" / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert any("rollout" in x for x in lanes) and any("actor" in x for x in lanes)
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and {r["step"] for r in rows} <= {0, 1, 2}
    assert all(r["step"] - r["gen_version"] <= 1 for r in rows)  # the staleness audit
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("timing_s/rollout" in m for m in metrics) and any("perf/idle_ratio/actor" in m for m in metrics)
    assert any(m.get("phase") == "rl" and "eval/accuracy" in m for m in metrics)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model", local_files_only=True)
    assert model.config.model_type == "qwen2"
    state = json.loads((out / "checkpoints" / "step_3" / "state.json").read_text())  # the final run checkpoint
    assert state["steps_done"] == 3 and state["in_flight"] == [] and (out / "checkpoints" / "step_3" / "actor").is_dir()
    assert all(m["tq/rows_held"] <= 2 * 4 * 4 for m in metrics if "tq/rows_held" in m)  # cleared steps are freed
    # the report can be redrawn from the logs alone
    from asyncflow.cli import main
    (out / "report" / "timeline.png").unlink()
    assert main(["report", str(out)]) == 0 and (out / "report" / "timeline.png").is_file()


@pytest.mark.slow
def test_sampled_evaluation_on_two_rollout_instances(tmp_path):
    """trainer.eval_samples: pass@k and mean@n beside greedy accuracy, the held-out prompts split
    over the two rollout instances of a colocated run; in metrics.jsonl and summary.json."""
    out = tmp_path / "run"
    ok(train(out, "grpo", "trainer.steps=1", "trainer.eval_every=0", "workflow.mode=sync", "placement.mode=colocated",
             "trainer.eval_samples=4", "trainer.eval_k=[1,2,4]", "reward.name=digits", timeout=400))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {m["phase"]: m for m in metrics if m.get("phase") in ("before_rl", "after_rl")}
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rollout_instances"]) == 2
    for phase, row in evals.items():
        figures = [row[f"eval/pass@{k}"] for k in (1, 2, 4)]
        assert all(0.0 <= f <= 1.0 for f in figures) and figures == sorted(figures), row
        assert row["eval/pass@1"] <= row["eval/mean@4"] <= 1.0  # digits gives partial credit below 1
        for key in ("pass@1", "pass@2", "pass@4", "mean@4"):
            assert summary[f"eval_{key}_{phase}"] == row[f"eval/{key}"]
    assert set(evals) == {"before_rl", "after_rl"}


@pytest.mark.slow
def test_the_time_budget_ends_rl(tmp_path):
    """The default job ends on trainer.time_budget_s, not on trainer.steps."""
    out = tmp_path / "run"
    ok(train(out, "grpo", "trainer.steps=100000", "trainer.time_budget_s=3", "trainer.eval_every=0"))
    summary = json.loads((out / "summary.json").read_text())
    assert 1 <= summary["rl_steps"] < 1000 and summary["rl_s"] < 60, summary


@pytest.mark.slow
def test_bad_config_key_fails_before_starting(tmp_path):
    p = train(tmp_path / "bad", "grpo", "trainer.no_such_key=1", timeout=60)
    assert p.returncode == 2
    assert "trainer.no_such_key" in p.stderr
    p = train(tmp_path / "bad", "grpo", "algorithm.advantage=nope", timeout=60)
    assert p.returncode == 2 and "algorithm.advantage" in p.stderr and "grpo" in p.stderr


@pytest.mark.slow
def test_prompts_from_a_jsonl_file(tmp_path):
    """The real-data path: prompts and answers from files, the math reward, long prompts dropped."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rows.append({"prompt": "1+2+3+4+5+6+7+8+9+10+11+12=", "answer": "78"})  # over the prompt limit
    data, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    out = tmp_path / "run"
    ok(train(out, "grpo", "data.task=file", f"data.path={data}", f"data.eval_path={held}",
             "data.max_prompt_tokens=8", "reward.name=math", "warmup.enabled=false", "trainer.steps=2",
             "algorithm.dynamic_sampling=false"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["filtered_prompts"] == 1
    assert summary["reward/errors"] == 0


@pytest.mark.slow
def test_a_missing_data_field_names_file_row_and_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    p = train(tmp_path / "run", "grpo", "data.task=file", f"data.path={data}", "warmup.enabled=false",
              "trainer.steps=1", timeout=120)
    assert p.returncode != 0
    err = p.stderr
    assert str(data) in err and "line 2" in err and "answer" in err, err[-3000:]


@pytest.mark.slow
def test_a_reward_model_served_by_the_training_engine(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=53, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    rm = tmp_path / "rm"
    Qwen2ForSequenceClassification(cfg).save_pretrained(rm)
    out = tmp_path / "run"
    ok(train(out, "grpo", f"reward.model_path={rm}", "trainer.steps=2", "algorithm.dynamic_sampling=false",
             "trainer.eval_every=0"))
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len({round(r["score"], 5) for r in rows}) > 1  # real model scores, not 0/1 rules
