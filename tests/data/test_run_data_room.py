"""Every prompt leaves room for the rollout's budget in the model's context: a prompt file's
longer prompts are dropped and counted, a built-in task whose prompts do not fit is refused."""
from __future__ import annotations

import json

import pytest

from asyncflow.config import load_config
from asyncflow.data.dataset import DataError
from asyncflow.data.run_data import build_prompt_data, prompt_room
from asyncflow.training.trainer import resolve_model


@pytest.fixture(scope="module")
def tiny() -> str:
    return resolve_model(load_config(None, []))  # context 128 tokens


def test_prompt_room_is_the_context_less_the_budget(tiny):
    assert prompt_room(load_config(None, ["rollout.max_new_tokens=8"]), tiny) == 120
    assert prompt_room(load_config(None, ["rollout.max_new_tokens=8", "rollout.max_kv_tokens=64"]), tiny) == 56


def test_a_prompt_file_drops_what_does_not_fit_and_counts_it(tmp_path, tiny):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": "1" * n + "+1=", "answer": "2"}) + "\n" for n in (3, 40, 90)))
    base = ["data.task=file", f"data.path={f}"]
    assert build_prompt_data(load_config(None, [*base, "rollout.max_new_tokens=8"]), tiny).filtered == 0
    data = build_prompt_data(load_config(None, [*base, "rollout.max_new_tokens=60"]), tiny)  # room 68
    assert data.filtered == 1 and len(data.train) == 2
    assert all(len(r["prompt_ids"]) <= 68 for r in data.eval_records)


def test_a_builtin_task_whose_prompts_do_not_fit_is_refused(tiny):
    with pytest.raises(DataError, match=r"rollout.max_new_tokens=125 leaves"):
        build_prompt_data(load_config(None, ["rollout.max_new_tokens=125"]), tiny)
    with pytest.raises(DataError, match="no room"):
        build_prompt_data(load_config(None, ["rollout.max_new_tokens=128"]), tiny)
