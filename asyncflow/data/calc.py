"""The built-in tool task: sums of three numbers, `347+58+906=`, answer `1311`.

The tiny character-level model cannot add three multi-digit numbers reliably in its head,
but it can learn to call a calculator and copy the result: its episode (recipes/calc_tool)
writes `<347+58+906>`, the calculator's output `1311#` is appended, and the model answers
`1311`. Records are generated from a seed; a fixed set is held out for evaluation.
"""
from __future__ import annotations

import random
from typing import Any

__all__ = ["CALL_OPEN", "CALL_CLOSE", "RESULT_END", "CalcTask", "calc_record", "demonstration"]

CALL_OPEN, CALL_CLOSE, RESULT_END = "<", ">", "#"
MAX_OPERAND = 999
TERMS = 3


def calc_record(index: int) -> dict[str, Any]:
    """The record of sum number ``index`` (its operands drawn from the index)."""
    rng = random.Random(f"calc:{index}")
    terms = [rng.randint(10, MAX_OPERAND) for _ in range(TERMS)]
    return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)), "index": index}


def demonstration(record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The text of a tool-using episode for ``record`` as (text, written by the model) pieces:
    the call, the calculator's output (not trained), the answer."""
    expr = record["prompt"].rstrip("=")
    return [(f"{CALL_OPEN}{expr}{CALL_CLOSE}", True), (f"{record['answer']}{RESULT_END}", False),
            (record["answer"], True)]


class CalcTask:
    """``num_train`` training sums and ``num_eval`` held-out ones (disjoint index ranges)."""

    def __init__(self, seed: int = 0, num_eval: int = 256, num_train: int = 20000) -> None:
        if num_eval < 1 or num_train < 1:
            raise ValueError(f"CalcTask: num_eval ({num_eval}) and num_train ({num_train}) must be >= 1")
        base = (seed % 1000) * 1_000_000  # another seed, other sums
        self._eval = [base + i for i in range(num_eval)]
        self._train = [base + num_eval + i for i in range(num_train)]

    def eval_records(self) -> list[dict[str, Any]]:
        return [calc_record(i) for i in self._eval]

    def all_train_records(self) -> list[dict[str, Any]]:
        return [calc_record(i) for i in self._train]
