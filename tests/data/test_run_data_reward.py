"""A prompt file checked against the run's reward at start: with reward.name=data_source every
record's data_source needs a rule (the first without one is named); a verl-layout file left to
the default `number` rule is warned about."""
from __future__ import annotations

import json
import logging

import pytest

from asyncflow.config import load_config
from asyncflow.data.dataset import DataError
from asyncflow.data.run_data import build_prompt_data
from asyncflow.training.trainer import resolve_model


@pytest.fixture(scope="module")
def tiny() -> str:
    return resolve_model(load_config(None, []))


def _row(i: int, data_source: str = "openai/gsm8k") -> dict:
    return {"data_source": data_source, "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"split": "train", "index": i}}


def _file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_source_without_a_rule_is_refused_at_start_naming_file_and_record(tmp_path, tiny):
    train = _file(tmp_path / "train.jsonl", [_row(0), _row(1, "lighteval/MATH")])
    held = _file(tmp_path / "test.jsonl", [_row(0), _row(1), _row(2, "my/own_set")])
    base = ["data.task=file", f"data.path={train}", "reward.name=data_source"]
    data = build_prompt_data(load_config(None, base), tiny)
    assert len(data.train) == 2 and data.eval_records[0]["metadata"]["data_source"] == "openai/gsm8k"
    with pytest.raises(DataError, match=rf"{held}, record 3: data_source 'my/own_set', and reward.name=data_source "
                                        r"has rules for openai/gsm8k, .* only; .*reward.custom_path"):
        build_prompt_data(load_config(None, [*base, f"data.eval_path={held}"]), tiny)
    # a reward file of one's own takes any data_source
    (tmp_path / "r.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.0\n")
    build_prompt_data(load_config(None, [*base, f"data.eval_path={held}", f"reward.custom_path={tmp_path / 'r.py'}"]),
                      tiny)


def test_a_verl_file_scored_by_the_default_number_rule_is_warned_about(tmp_path, tiny, caplog):
    train = _file(tmp_path / "train.jsonl", [_row(0), _row(1)])
    with caplog.at_level(logging.WARNING, logger="asyncflow.data.run_data"):
        build_prompt_data(load_config(None, ["data.task=file", f"data.path={train}"]), tiny)
        warned = [r.getMessage() for r in caplog.records if "verl's layout" in r.getMessage()]
        assert warned and "reward.name=data_source" in warned[0] and str(train) in warned[0]
        caplog.clear()
        build_prompt_data(load_config(None, ["data.task=file", f"data.path={train}", "reward.name=math"]), tiny)
        assert not [r for r in caplog.records if "verl's layout" in r.getMessage()]
