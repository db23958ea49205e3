"""Dataset keys as dotted paths into nested records, and verl's preprocessed layout read with
no keys given: chat-message prompts, the answer in reward_model.ground_truth, data_source,
ability and extra_info as the record's metadata."""
from __future__ import annotations

import json

import pytest

from asyncflow.data import DataConfig, DataError, PromptDataset
from asyncflow.data.fields import FieldError, answer_key_of, get_field


def verl_gsm8k_row(i: int, question: str, answer: str, split: str = "train") -> dict:
    """A record as verl's GSM8K preprocessing writes it."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "answer": f"so #### {answer}", "question": question}}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_get_field_reads_top_level_and_dotted_keys():
    row = {"a": {"b": {"c": 3}}, "x.y": 1, "s": "text"}
    assert get_field(row, "a.b.c") == 3 and get_field(row, "x.y") == 1  # a top-level name with a dot first
    with pytest.raises(FieldError, match=r"missing field 'a.b.d' \('a.b' has fields \['c'\]\)"):
        get_field(row, "a.b.d")
    with pytest.raises(FieldError, match=r"missing field 'q.r' \(no field 'q'; fields present"):
        get_field(row, "q.r")
    with pytest.raises(FieldError, match=r"missing field 's.t': 's' is a str, not a record with field 't'"):
        get_field(row, "s.t")


def test_the_default_answer_key_falls_back_to_verls_ground_truth_only():
    verl = verl_gsm8k_row(0, "1+1=", "2")
    assert answer_key_of(verl, "answer") == "reward_model.ground_truth"
    assert answer_key_of({**verl, "answer": "3"}, "answer") == "answer"  # a top-level answer wins
    assert answer_key_of(verl, "target") == "target"  # a key the user gave is kept as given


@pytest.mark.parametrize("keys", [{}, {"answer_key": "reward_model.ground_truth"}])
def test_verl_rows_read_with_or_without_keys(tmp_path, char_tok, keys):
    p = _jsonl(tmp_path / "d.jsonl", [verl_gsm8k_row(0, "3+4=", "7"), verl_gsm8k_row(1, "5+5=", "10")])
    ds = PromptDataset(DataConfig(path=str(p), shuffle=False, **keys), char_tok)
    r = next(ds)
    assert char_tok.decode(r["prompt_ids"]) == "user:3+4=\nassistant:" and r["answer"] == "7"
    meta = r["metadata"]
    assert meta["data_source"] == "openai/gsm8k" and meta["ability"] == "math"
    assert meta["extra_info"] == {"split": "train", "index": 0, "answer": "so #### 7", "question": "3+4="}
    assert "prompt" not in meta and next(ds)["answer"] == "10"


def test_a_dotted_prompt_key(tmp_path, char_tok):
    p = _jsonl(tmp_path / "d.jsonl", [{"q": {"text": "2*3=", "id": 4}, "a": {"value": 6}}])
    r = next(PromptDataset(DataConfig(path=str(p), prompt_key="q.text", answer_key="a.value"), char_tok))
    assert char_tok.decode(r["prompt_ids"]) == "2*3=" and r["answer"] == "6"
    assert r["metadata"] == {"q": {"text": "2*3=", "id": 4}, "a": {"value": 6}}  # parents stay as metadata


@pytest.mark.parametrize("rows,keys,match", [
    ([{"prompt": "1=", "reward_model": {"style": "rule"}}], {"answer_key": "reward_model.ground_truth"},
     (r"d\.jsonl, line 1: missing field 'reward_model.ground_truth' \('reward_model' has fields \['style'\]\); "
      r"set data.answer_key")),
    ([{"prompt": "1=", "answer": "1"}], {"answer_key": "reward_model.ground_truth"},
     r"line 1: missing field 'reward_model.ground_truth' \(no field 'reward_model'"),
    ([verl_gsm8k_row(0, "1=", "1"), {**verl_gsm8k_row(1, "1=", "1"), "reward_model": {"style": "rule"}}], {},
     r"line 2: missing field 'answer' \(fields present: \['ability', 'data_source'"),
    ([{"q": {"id": 1}, "answer": "1"}], {"prompt_key": "q.text"},
     r"line 1: missing field 'q.text' \('q' has fields \['id'\]\); set data.prompt_key"),
    ([{**verl_gsm8k_row(0, "1=", "1"), "reward_model": {"ground_truth": ["1", "one"]}}], {},
     r"line 1: field 'reward_model.ground_truth' has type list; expected a string or a number"),
])
def test_keys_that_do_not_resolve_name_file_row_and_key(tmp_path, char_tok, rows, keys, match):
    p = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=match):
        PromptDataset(DataConfig(path=str(p), **keys), char_tok)


def test_a_verl_parquet_file(tmp_path, char_tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_gsm8k_row(i, f"{i}+1=", str(i + 1)) for i in range(3)]), str(p))
    ds = PromptDataset(DataConfig(path=str(p), shuffle=False), char_tok)
    rows = ds.take(3)
    assert [r["answer"] for r in rows] == ["1", "2", "3"]
    assert rows[2]["metadata"]["extra_info"]["index"] == 2 and rows[2]["metadata"]["data_source"] == "openai/gsm8k"
    assert char_tok.decode(rows[1]["prompt_ids"]) == "user:1+1=\nassistant:"
