"""verl's files work unchanged: a parquet file as verl's GSM8K preprocessing writes it trains a
few RL steps with no data keys given, scored by a reward file written for verl's
custom_reward_function; the metadata reaches the function and its extra keys reach
metrics.jsonl."""
from __future__ import annotations

import json
import random

import pytest
from _run import ok, train

pytestmark = pytest.mark.slow

# Raises (and with reward.on_error=fail stops the run) unless verl's arguments arrive as verl passes them.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if (data_source != "openai/gsm8k" or not isinstance(extra_info, dict) or "question" not in extra_info
            or extra_info.get("split") not in ("train", "test") or not isinstance(ground_truth, str)):
        raise ValueError(f"not verl's arguments: {data_source!r}, {extra_info!r}, {ground_truth!r}")
    hit = solution_str.strip() == ground_truth
    return {"score": 1.0 if hit else 0.0, "acc": hit, "length": len(solution_str)}
'''


def _verl_rows(split: str, pairs: list[tuple[int, int]]) -> list[dict]:
    """The schema of verl's examples/data_preprocess/gsm8k.py output."""
    out = []
    for i, (a, b) in enumerate(pairs):
        question = f"{a}+{b}"
        out.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question + "="}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"split": split, "index": i, "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                                   "question": question}})
    return out


def _parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = random.Random(0)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(80)]
    train_file, test_file = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows("train", pairs[:64])), str(train_file))
    pq.write_table(pa.Table.from_pylist(_verl_rows("test", pairs[64:])), str(test_file))
    return train_file, test_file


def test_a_verl_parquet_and_a_verl_reward_file_train_unchanged(tmp_path):
    train_file, test_file = _parquet_files(tmp_path)
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    ok(train(out, "grpo", "data.task=file", f"data.path={train_file}", f"data.eval_path={test_file}",
             f"reward.custom_path={reward}", "reward.on_error=fail", "warmup.enabled=false", "trainer.steps=2",
             "trainer.eval_every=1", "algorithm.dynamic_sampling=false"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["reward/errors"] == 0, summary
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in rows if "eval/accuracy" in m]
    assert {m["phase"] for m in evals} >= {"before_rl", "rl", "after_rl"}
    for m in evals:  # every evaluation scores its 16 held-out rows with the file's function
        assert 0.0 <= m["eval/extra/acc"] <= 1.0 and m["eval/extra/length"] > 0, m
    # over the training rows scored since the previous evaluation: none before RL; the rows of both
    # steps by the last (async rollout runs ahead, so an evaluation may find no new row)
    assert "reward/extra/acc" not in evals[0]
    trained = [m for m in evals if "reward/extra/length" in m]
    assert trained and all(m["reward/extra/length"] > 0 and 0 <= m["reward/extra/acc"] <= 1 for m in trained), evals
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {r["step"] for r in samples} <= {0, 1}


def test_a_reward_file_returning_no_score_stops_the_run_naming_file_function_and_row(tmp_path):
    train_file, _ = _parquet_files(tmp_path)
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'acc': 1.0}\n")
    p = train(tmp_path / "run", "grpo", "data.task=file", f"data.path={train_file}", f"reward.custom_path={reward}",
              "warmup.enabled=false", "trainer.steps=1", timeout=180)  # reward.on_error=zero, the default
    assert p.returncode != 0
    assert (f"reward file {reward}: compute_score returned a dict without a numeric 'score' (keys ['acc'])"
            in p.stderr and "failed on row " in p.stderr and "extra_info.index" in p.stderr), p.stderr[-4000:]
