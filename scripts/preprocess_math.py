#!/usr/bin/env python
"""Convert public math datasets to AsyncFlow's prompt jsonl: {"prompt", "answer", "metadata"}.

  GSM8K      .jsonl / .parquet rows {"question", "answer"}; the answer's reasoning
             ends in "#### 72", which becomes the reference answer "72".
  DeepScaleR .json (a list) / .jsonl rows {"problem", "answer", "solution"}.

Needs the asyncflow package (its file reader); pyarrow only for parquet input. Example:
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
    input_path: Path, output_path: Path, fmt: str = "auto", instruction: str | None = None, limit: int | None = None
) -> int:
    """Convert input_path into output_path (jsonl); returns the number of records written."""
    if fmt not in FORMATS:
        raise PreprocessError(f"format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not input_path.is_file():
        raise PreprocessError(f"input file {input_path} does not exist")
    converters = {"gsm8k": convert_gsm8k, "deepscaler": convert_deepscaler}
    records = []
    for i, (where, row) in enumerate(read_rows(input_path)):
        if limit is not None and i >= limit:
            break
        kind = detect_format(row, where) if fmt == "auto" else fmt
        rec = converters[kind](row, where)
        if instruction:
            rec["prompt"] = f"{rec['prompt']} {instruction}"
        rec["metadata"]["source_row"] = i
        records.append(rec)
    if not records:
        raise PreprocessError(f"{input_path}: no records")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:  # written whole, then renamed: no half files
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(output_path)
    return len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help=".jsonl, .json or .parquet file")
    parser.add_argument("--output", required=True, type=Path, help="output .jsonl")
    parser.add_argument("--format", default="auto", choices=FORMATS)
    parser.add_argument("--instruction", default=None, help="text appended to every prompt")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N records")
    args = parser.parse_args(argv)
    try:
        n = convert(args.input, args.output, args.format, args.instruction, args.limit)
    except PreprocessError as exc:
        print(f"preprocess_math: error: {exc}", file=sys.stderr)
        return 2
    print(f"preprocess_math: wrote {n} records to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
