"""The built-in task: `a+b=` with a, b in 0..99, answer `str(a+b)`.

A tiny character-level model learns it in seconds of warm-up and RL lifts it
further, and the answer is checked exactly. A fixed,
seeded set of pairs is held out for evaluation and never appears in training.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

__all__ = ["AdditionTask", "addition_record"]

MAX_OPERAND = 99
_NUM_PAIRS = (MAX_OPERAND + 1) ** 2


def addition_record(index: int) -> dict[str, Any]:
    """The record of pair number `index` (a = index // 100, b = index % 100)."""
    if not 0 <= index < _NUM_PAIRS:
        raise ValueError(f"addition_record: index {index} outside 0..{_NUM_PAIRS - 1}")
    a, b = divmod(index, MAX_OPERAND + 1)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "index": index}


class AdditionTask:
    """Held-out eval prompts and a training stream that never contains them.

    Records are `{"prompt": "12+34=", "answer": "46", "index": 1234}`; the index
    identifies the pair, so it is the same in every split and every run.
    """

    def __init__(self, seed: int = 0, num_eval: int = 256) -> None:
        if not 0 < num_eval < _NUM_PAIRS:
            raise ValueError(f"AdditionTask: num_eval {num_eval} must be in 1..{_NUM_PAIRS - 1}")
        self.seed = seed
        self.num_eval = num_eval
        # The held-out set depends on the seed only, so evaluation is comparable across runs.
        held_out = sorted(random.Random(f"addition-eval:{seed}").sample(range(_NUM_PAIRS), num_eval))
        held = set(held_out)
        self._eval_indices: list[int] = held_out
        self._train_indices: list[int] = [i for i in range(_NUM_PAIRS) if i not in held]

    @property
    def train_indices(self) -> list[int]:
        return list(self._train_indices)

    @property
    def eval_indices(self) -> list[int]:
        return list(self._eval_indices)

    def eval_records(self) -> list[dict[str, Any]]:
        """The fixed held-out prompts, in index order."""
        return [addition_record(i) for i in self._eval_indices]

    def all_train_records(self) -> list[dict[str, Any]]:
        """Every training pair once, in index order (for PromptDataset-style epochs)."""
        return [addition_record(i) for i in self._train_indices]

    def train_records(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        """n training records drawn uniformly, with replacement, using `rng`."""
        return [addition_record(i) for i in rng.choices(self._train_indices, k=n)]

    def iter_train(self, seed: int | None = None) -> Iterator[dict[str, Any]]:
        """An endless stream of training records, reproducible from `seed`."""
        rng = random.Random(f"addition-train:{self.seed if seed is None else seed}")
        while True:
            yield addition_record(rng.choice(self._train_indices))

    def sft_examples(self, eos_token: str = "<eos>", seed: int | None = None) -> list[dict[str, Any]]:
        """Supervised warm-up examples: every training pair once, shuffled.

        Each has `prompt`, `completion` (answer + eos; the loss goes on it alone),
        `text` (prompt + completion), `answer` and `index`.
        """
        order = list(self._train_indices)
        random.Random(f"addition-sft:{self.seed if seed is None else seed}").shuffle(order)
        out = []
        for i in order:
            rec = addition_record(i)
            rec["completion"] = rec["answer"] + eos_token
            rec["text"] = rec["prompt"] + rec["completion"]
            out.append(rec)
        return out
