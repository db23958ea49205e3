#!/usr/bin/env python
"""Convert public math datasets into prompt files AsyncFlow trains on.

Files that verl's preprocessing scripts wrote (parquet rows {data_source, prompt: chat messages,
ability, reward_model: {style, ground_truth}, extra_info}) need no conversion: train on them as
they are (data.task=file data.path=train.parquet; see docs/porting.md). This script converts the
raw sets:

  GSM8K      .jsonl / .parquet rows {"question", "answer"}; the answer's reasoning
             ends in "#### 72", which becomes the reference answer "72".
  DeepScaleR .json (a list) / .jsonl rows {"problem", "answer", "solution"}.

into one of two layouts (--layout), written as .jsonl or .parquet (by the output's suffix):

  asyncflow  {"prompt", "answer", "metadata"} (the default);
  verl       verl's preprocessed layout, which verl and AsyncFlow both read: data_source
             (openai/gsm8k, agentica-org/DeepScaleR-Preview-Dataset: both scored by
             reward.name=data_source), prompt [{"role": "user", "content": ...}], ability "math",
             reward_model {"style": "rule", "ground_truth"}, extra_info {split, index, question, solution}.

Needs the asyncflow package (its file reader); pyarrow only for parquet input or output. Example:
  python scripts/preprocess_math.py --format gsm8k --input train.parquet --output gsm8k_train.jsonl \
      --instruction "Let's think step by step and output the final answer within \\boxed{}."
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMATS = ("gsm8k", "deepscaler", "auto")
LAYOUTS = ("asyncflow", "verl")
VERL_SOURCES = {"gsm8k": "openai/gsm8k", "deepscaler": "agentica-org/DeepScaleR-Preview-Dataset"}


class PreprocessError(ValueError):
    """A row of the input cannot be converted; the message names file, row and field."""


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for each record of a .jsonl, .json or .parquet file (the reader the
    trainer's datasets use, so both accept the same files)."""
    from asyncflow.data.dataset import DataError, read_records
    try:
        for where, row in read_records(path):
            yield f"{path}, {where}", row
    except DataError as exc:
        raise PreprocessError(str(exc)) from exc


def _field(row: Any, key: str, where: str) -> str:
    if not isinstance(row, dict):
        raise PreprocessError(f"{where}: record is a {type(row).__name__}; expected an object")
    if key not in row:
        raise PreprocessError(f"{where}: missing field {key!r} (fields present: {sorted(row)})")
    value = row[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise PreprocessError(f"{where}: field {key!r} is {value!r}; expected a non-empty string")
    return value


def convert_gsm8k(row: Any, where: str) -> dict[str, Any]:
    question = _field(row, "question", where)
    full = _field(row, "answer", where)
    if "####" not in full:
        raise PreprocessError(f"{where}: field 'answer' has no '#### <number>' final line: {full[-80:]!r}")
    reasoning, final = full.rsplit("####", 1)
    final = final.strip().replace(",", "")  # "1,000" -> "1000"
    if not final:
        raise PreprocessError(f"{where}: field 'answer' has nothing after '####'")
    return {"prompt": question.strip(), "answer": final, "metadata": {"source": "gsm8k", "solution": reasoning.strip()}}


def convert_deepscaler(row: Any, where: str) -> dict[str, Any]:
    problem = _field(row, "problem", where)
    answer = _field(row, "answer", where)
    meta: dict[str, Any] = {"source": "deepscaler"}
    if isinstance(row.get("solution"), str):
        meta["solution"] = row["solution"]
    return {"prompt": problem.strip(), "answer": answer.strip(), "metadata": meta}


def refuse_verl_rows(row: Any, where: str, path: Path) -> None:
    """A row verl's preprocessing already wrote is trained on as it is, not converted again."""
    if isinstance(row, dict) and "reward_model" in row and "prompt" in row:
        raise PreprocessError(
            f"{where}: already in verl's preprocessed layout (prompt, reward_model.ground_truth); AsyncFlow "
            f"trains on it as it is: data.task=file data.path={path} (docs/porting.md)"
        )


def verl_record(rec: dict[str, Any], kind: str, index: int, split: str, question: str) -> dict[str, Any]:
    """A converted record in verl's preprocessed layout."""
    info: dict[str, Any] = {"split": split, "index": index, "question": question}
    if "solution" in rec["metadata"]:
        info["solution"] = rec["metadata"]["solution"]
    return {"data_source": VERL_SOURCES[kind], "prompt": [{"role": "user", "content": rec["prompt"]}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": rec["answer"]}, "extra_info": info}


def write_records(records: list[dict[str, Any]], output_path: Path) -> None:
    """Written whole to a temporary file, then renamed: no half files."""
    suffix = output_path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise PreprocessError(f"output file {output_path}: expected a .jsonl or .parquet name")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    if suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise PreprocessError(f"{output_path}: writing parquet needs pyarrow: pip install pyarrow") from exc
        pq.write_table(pa.Table.from_pylist(records), str(tmp))
    else:
        with tmp.open("w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(output_path)


def detect_format(row: Any, where: str) -> str:
    if isinstance(row, dict) and "question" in row:
        return "gsm8k"
    if isinstance(row, dict) and "problem" in row:
        return "deepscaler"
    fields = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise PreprocessError(
        f"{where}: cannot tell the format (fields {fields}); expected 'question' (gsm8k) or 'problem' "
        f"(deepscaler), or pass --format"
    )


def convert(
    input_path: Path, output_path: Path, fmt: str = "auto", instruction: str | None = None, limit: int | None = None,
    layout: str = "asyncflow", split: str = "train",
) -> int:
    """Convert input_path into output_path (.jsonl or .parquet); returns the number of records written."""
    if fmt not in FORMATS:
        raise PreprocessError(f"format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if layout not in LAYOUTS:
        raise PreprocessError(f"layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if not input_path.is_file():
        raise PreprocessError(f"input file {input_path} does not exist")
    converters = {"gsm8k": convert_gsm8k, "deepscaler": convert_deepscaler}
    records = []
    for i, (where, row) in enumerate(read_rows(input_path)):
        if limit is not None and i >= limit:
            break
        refuse_verl_rows(row, where, input_path)
        kind = detect_format(row, where) if fmt == "auto" else fmt
        rec = converters[kind](row, where)
        question = rec["prompt"]
        if instruction:
            rec["prompt"] = f"{rec['prompt']} {instruction}"
        rec["metadata"]["source_row"] = i
        records.append(verl_record(rec, kind, i, split, question) if layout == "verl" else rec)
    if not records:
        raise PreprocessError(f"{input_path}: no records")
    write_records(records, output_path)
    return len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help=".jsonl, .json or .parquet file")
    parser.add_argument("--output", required=True, type=Path, help="output .jsonl or .parquet")
    parser.add_argument("--format", default="auto", choices=FORMATS)
    parser.add_argument("--layout", default="asyncflow", choices=LAYOUTS,
                        help="asyncflow: {prompt, answer, metadata}; verl: verl's preprocessed layout")
    parser.add_argument("--split", default="train", help="extra_info.split of the verl layout")
    parser.add_argument("--instruction", default=None, help="text appended to every prompt")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N records")
    args = parser.parse_args(argv)
    try:
        n = convert(args.input, args.output, args.format, args.instruction, args.limit, args.layout, args.split)
    except PreprocessError as exc:
        print(f"preprocess_math: error: {exc}", file=sys.stderr)
        return 2
    print(f"preprocess_math: wrote {n} records to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
