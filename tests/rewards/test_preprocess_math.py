"""scripts/preprocess_math.py on tiny handmade GSM8K and DeepScaleR files."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_math.py"


@pytest.fixture(scope="module")
def pm():
    spec = importlib.util.spec_from_file_location("preprocess_math", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GSM = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs?", "answer": "It is 1,000 + 200.\n#### 1,200"},
]
DSR = [
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "answer": "\\frac{3}{4}", "solution": "Add: 3/4."},
    {"problem": "What is 2+2?", "answer": 4, "solution": "4"},
]


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k_jsonl(pm, tmp_path):
    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    out = tmp_path / "out" / "gsm.jsonl"
    assert pm.convert(src, out, "gsm8k", instruction="Answer in \\boxed{}.") == 2
    recs = _read(out)
    assert recs[0]["prompt"] == "Tom has 3 apples and buys 4. How many? Answer in \\boxed{}."
    assert [r["answer"] for r in recs] == ["7", "1200"]
    assert recs[1]["metadata"] == {"source": "gsm8k", "solution": "It is 1,000 + 200.", "source_row": 1}


def test_gsm8k_parquet(pm, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "gsm.parquet"
    pq.write_table(pa.Table.from_pylist(GSM), str(src))
    out = tmp_path / "gsm.jsonl"
    assert pm.convert(src, out) == 2  # auto-detected
    assert _read(out)[0]["answer"] == "7"


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_deepscaler(pm, tmp_path, suffix):
    src = tmp_path / f"dsr{suffix}"
    src.write_text(json.dumps(DSR) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in DSR))
    out = tmp_path / "dsr.jsonl"
    assert pm.convert(src, out, "auto", limit=5) == 2
    recs = _read(out)
    assert recs[0] == {"prompt": DSR[0]["problem"], "answer": "\\frac{3}{4}",
                       "metadata": {"source": "deepscaler", "solution": "Add: 3/4.", "source_row": 0}}
    assert recs[1]["answer"] == "4"


def test_output_loads_as_prompt_dataset(pm, tmp_path):
    from asyncflow.data import DataConfig, PromptDataset

    src = tmp_path / "dsr.json"
    src.write_text(json.dumps(DSR))
    out = tmp_path / "dsr.jsonl"
    pm.convert(src, out)

    class _Tok:  # whitespace tokenizer: enough to check the file's shape
        chat_template = None

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[1] * len(t.split()) for t in texts]}

    ds = PromptDataset(DataConfig(path=str(out), shuffle=False), _Tok())
    rec = next(ds)
    assert rec["answer"] == "\\frac{3}{4}" and rec["metadata"]["source"] == "deepscaler"


@pytest.mark.parametrize("rows,fmt,match", [
    ([{"question": "q", "answer": "no marker"}], "gsm8k", r"line 1: field 'answer' has no '#### <number>'"),
    ([GSM[0], {"question": "q"}], "gsm8k", r"line 2: missing field 'answer'"),
    ([{"problem": "", "answer": "1"}], "deepscaler", r"line 1: field 'problem' is ''"),
    ([{"text": "x"}], "auto", r"line 1: cannot tell the format \(fields \['text'\]\)"),
])
def test_errors_name_row_and_field(pm, tmp_path, rows, fmt, match):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(pm.PreprocessError, match=match):
        pm.convert(src, tmp_path / "o.jsonl", fmt)
    assert not (tmp_path / "o.jsonl").exists()


def test_cli(tmp_path):
    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    out = tmp_path / "o.jsonl"
    ok = subprocess.run([sys.executable, str(SCRIPT), "--input", str(src), "--output", str(out)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "wrote 2 records" in ok.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--input", str(tmp_path / "none.jsonl"), "--output", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_layout_is_what_verl_writes_and_trains_as_it_is(pm, tmp_path, suffix):
    """--layout verl: verl's preprocessed schema, read back by the dataset with no keys given and
    scored by reward.name=data_source."""
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    from asyncflow.data import DataConfig, PromptDataset
    from asyncflow.rewards import RewardRunner

    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    out = tmp_path / f"train{suffix}"
    assert pm.convert(src, out, instruction="Think.", layout="verl", split="test") == 2
    rows = [r for _, r in pm.read_rows(out)]
    assert rows[1] == {"data_source": "openai/gsm8k", "ability": "math",
                       "prompt": [{"role": "user", "content": "A car costs? Think."}],
                       "reward_model": {"style": "rule", "ground_truth": "1200"},
                       "extra_info": {"split": "test", "index": 1, "question": "A car costs?",
                                      "solution": "It is 1,000 + 200."}}

    class _Tok:
        chat_template = None

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[1] * len(t.split()) for t in texts]}

    recs = PromptDataset(DataConfig(path=str(out), shuffle=False), _Tok()).take(2)
    assert [r["answer"] for r in recs] == ["7", "1200"]
    scores, _ = RewardRunner("data_source").score(["so #### 7", "#### 1,200"], [r["answer"] for r in recs],
                                                  [r["metadata"] for r in recs])
    assert scores == [1.0, 1.0]
    # a file verl already wrote is not converted again
    with pytest.raises(pm.PreprocessError, match=r"(row|line) 1: already in verl's preprocessed layout .*"
                                                 r"trains on it as it is: data.task=file data.path="):
        pm.convert(out, tmp_path / "again.jsonl")


def test_bad_layout_and_output_names(pm, tmp_path):
    src = tmp_path / "gsm.jsonl"
    src.write_text(json.dumps(GSM[0]) + "\n")
    with pytest.raises(pm.PreprocessError, match="layout 'nemo'"):
        pm.convert(src, tmp_path / "o.jsonl", layout="nemo")
    with pytest.raises(pm.PreprocessError, match=r"o\.csv: expected a \.jsonl or \.parquet name"):
        pm.convert(src, tmp_path / "o.csv")
