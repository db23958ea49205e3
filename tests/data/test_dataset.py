"""PromptDataset: file formats, errors naming file/row/field, filtering, resumable order."""
from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

from asyncflow.data import (
    BUILTIN_ADDITION,
    AdditionTask,
    DataConfig,
    DataError,
    PromptDataset,
    addition_dataset,
    load_prompt_dataset,
)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "metadata": {"k": i}} for i in range(n)]


def test_jsonl_records(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl",
               [{"prompt": "2+2=", "answer": 4, "level": "easy"}, {"prompt": "1+1=", "answer": "2"}])
    ds = PromptDataset(DataConfig(path=str(p), shuffle=False), char_tok)
    assert len(ds) == 2
    r = next(ds)
    assert r["prompt_ids"].dtype == torch.long and char_tok.decode(r["prompt_ids"]) == "2+2="
    assert r["answer"] == "4" and r["index"] == 0 and r["metadata"] == {"level": "easy"}
    assert next(ds)["index"] == 1


def test_custom_keys_and_chat_template(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "1+2=", "target": "3"}])
    cfg = DataConfig(path=str(p), prompt_key="question", answer_key="target", chat_template=True,
                     system_prompt="add")
    r = next(PromptDataset(cfg, char_tok))
    assert char_tok.decode(r["prompt_ids"]) == "system:add\nuser:1+2=\nassistant:"


def test_message_list_prompts_use_the_template(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "3*3="}], "answer": "9"}])
    r = next(PromptDataset(DataConfig(path=str(p)), char_tok))
    assert char_tok.decode(r["prompt_ids"]) == "user:3*3=\nassistant:"


@pytest.mark.parametrize("rows,match", [
    ([{"prompt": "1+1=", "answer": "2"}, {"answer": "3"}], r"d\.jsonl, line 2: missing field 'prompt'"),
    ([{"prompt": "1+1="}], r"d\.jsonl, line 1: missing field 'answer'"),
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "  ", "answer": "3"}],
     r"line 2: field 'prompt' is an empty prompt"),
    ([{"prompt": "1+1=", "answer": "2"}, '{"prompt": "1+', ], r"d\.jsonl, line 2: invalid JSON"),
    ([{"prompt": 12, "answer": "2"}], r"line 1: field 'prompt' has type int"),
    ([{"prompt": "1+1=", "answer": ["2"]}], r"line 1: field 'answer' has type list"),
    ([{"prompt": "1+1=", "answer": None}], r"line 1: field 'answer' has type NoneType"),
    ([{"prompt": "1+1=", "answer": "2", "metadata": 5}], r"line 1: field 'metadata' has type int"),
    ([[1, 2]], r"line 1: record is a list"),
    ([{"prompt": [{"role": "user"}], "answer": "2"}], r"line 1: field 'prompt' message 0"),
    ([{"prompt": [], "answer": "2"}], r"line 1: field 'prompt' is an empty message list"),
    ([{"prompt": "ÉÉ", "answer": "2"}], r"line 1: prompt tokenizes to no tokens"),
])
def test_bad_rows_name_file_row_field(tmp_path, char_tok, rows, match):
    p = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=match):
        PromptDataset(DataConfig(path=str(p)), char_tok)


def test_blank_lines_are_skipped_but_counted(tmp_path, char_tok):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "1+1="}\n')
    with pytest.raises(DataError, match="line 3: missing field 'answer'"):
        PromptDataset(DataConfig(path=str(p)), char_tok)


@pytest.mark.parametrize("name,content,match", [
    ("d.csv", "a,b", "unsupported file type '.csv'"),
    ("d.jsonl", "", "no records"),
    ("d.json", '{"prompt": "x"}', "expected a list of records"),
    ("d.json", '[{"prompt": "1=", "answer": "1"}, {"prompt": "2="}]', r"d\.json, item 2: missing field 'answer'"),
])
def test_bad_files(tmp_path, char_tok, name, content, match):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        PromptDataset(DataConfig(path=str(p)), char_tok)


def test_missing_file(tmp_path, char_tok):
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset(DataConfig(path=str(tmp_path / "none.jsonl")), char_tok)


def test_long_prompts_are_filtered_counted_and_logged(tmp_path, char_tok, caplog):
    rows = [{"prompt": "1" * n, "answer": "1"} for n in (3, 9, 5, 12)]
    p = _jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="asyncflow.data.dataset"):
        ds = PromptDataset(DataConfig(path=str(p), max_prompt_tokens=5, shuffle=False), char_tok)
    assert ds.num_filtered == 2 and ds.filtered_indices == [1, 3]
    assert [r["index"] for r in ds.take(2)] == [0, 2]
    assert [len(r["prompt_ids"]) for r in ds.take(2)] == [3, 5]  # never truncated
    assert any("dropped 2 of 4" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match="all 4 prompts are longer than max_prompt_tokens=2"):
        PromptDataset(DataConfig(path=str(p), max_prompt_tokens=2), char_tok)


def test_epochs_are_seeded_shuffles(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl", _rows(20))
    ds = PromptDataset(DataConfig(path=str(p), seed=1), char_tok)
    e0 = [r["index"] for r in ds.take(20)]
    e1 = [r["index"] for r in ds.take(20)]
    assert sorted(e0) == sorted(e1) == list(range(20)) and e0 != e1 and ds.epoch == 1
    again = PromptDataset(DataConfig(path=str(p), seed=1), char_tok)
    assert [r["index"] for r in again.take(20)] == e0
    other = PromptDataset(DataConfig(path=str(p), seed=2), char_tok)
    assert [r["index"] for r in other.take(20)] != e0


@pytest.mark.parametrize("consumed", [0, 3, 7, 14, 21])
def test_resume_continues_with_the_next_prompt(tmp_path, char_tok, consumed):
    p = _jsonl(tmp_path / "d.jsonl", _rows(7))
    cfg = DataConfig(path=str(p), seed=5)
    ref = PromptDataset(cfg, char_tok)
    expected = [r["index"] for r in ref.take(consumed + 10)][consumed:]
    run = PromptDataset(cfg, char_tok)
    run.take(consumed)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    resumed = PromptDataset(cfg, char_tok)
    resumed.load_state_dict(state)
    assert [r["index"] for r in resumed.take(10)] == expected


def test_resume_refuses_changed_data(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl", _rows(7))
    state = PromptDataset(DataConfig(path=str(p)), char_tok).state_dict()
    q = _jsonl(tmp_path / "e.jsonl", _rows(8))
    with pytest.raises(DataError, match="num_records=7 but the dataset has 8"):
        PromptDataset(DataConfig(path=str(q)), char_tok).load_state_dict(state)
    with pytest.raises(DataError, match="seed=-1 but the dataset has 9"):
        PromptDataset(DataConfig(path=str(p), seed=9), char_tok).load_state_dict(state)


def test_parquet(tmp_path, char_tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "answer": "3"}, {"prompt": "", "answer": "4"}]), str(p))
    with pytest.raises(DataError, match=r"d\.parquet, row 2: field 'prompt' is an empty prompt"):
        PromptDataset(DataConfig(path=str(p)), char_tok)
    pq.write_table(pa.Table.from_pylist(_rows(3)), str(p))
    ds = PromptDataset(DataConfig(path=str(p), shuffle=False), char_tok)
    r = next(ds)
    assert char_tok.decode(r["prompt_ids"]) == "0+1=" and r["answer"] == "1" and r["metadata"] == {"k": 0}


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, char_tok, monkeypatch):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        PromptDataset(DataConfig(path=str(p)), char_tok)


def test_addition_task_through_the_same_interface(char_tok):
    task = AdditionTask(seed=0, num_eval=256)
    ds = load_prompt_dataset(DataConfig(path=BUILTIN_ADDITION, seed=0), char_tok)
    assert len(ds) == 10000 - 256
    held = set(task.eval_indices)
    seen = ds.take(len(ds))
    assert {r["index"] for r in seen} == set(task.train_indices) and not held & {r["index"] for r in seen}
    r = seen[0]
    a, b = map(int, char_tok.decode(r["prompt_ids"])[:-1].split("+"))
    assert r["index"] == a * 100 + b and r["answer"] == str(a + b) and r["metadata"] == {}
    state = ds.state_dict()
    nxt = next(ds)["index"]
    again = addition_dataset(char_tok, task, DataConfig(path=BUILTIN_ADDITION, seed=0))
    again.load_state_dict(state)
    assert next(again)["index"] == nxt
