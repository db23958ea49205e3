"""A run's prompt data from its config: training stream, held-out set, warm-up examples."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .addition import AdditionTask
from .dataset import BUILTIN_ADDITION, PromptDataset, addition_dataset


@dataclass
class RunData:
    train: PromptDataset
    eval_records: list[dict[str, Any]]  # {"prompt_ids": list[int], "answer": str, "prompt": str, "metadata": dict}
    # (prompt, target) pairs, or (prompt, target, loss mask) where some target tokens are not the model's
    sft_examples: Callable[[int, random.Random], list[tuple]] | None
    filtered: int = 0

    def train_records(self) -> Iterator[dict[str, Any]]:
        return iter(self.train)


def _calc_data(d: Any, tok: Any, seed: int) -> RunData:
    """The tool task: its sums, held-out sums, and tool-using demonstrations whose calculator
    output is masked out of the supervised loss."""
    from .calc import CalcTask, demonstration

    task = CalcTask(seed=seed, num_eval=d.num_eval)
    records = task.all_train_records()
    train = PromptDataset.from_records(records, tok, dataclasses.replace(d, path="builtin:calc"),
                                       source="builtin:calc")
    train._index = [train._meta[k].pop("index") for k in range(len(train))]
    evals = [{"prompt_ids": tok.encode(r["prompt"], add_special_tokens=False), "answer": r["answer"],
              "prompt": r["prompt"], "metadata": {}} for r in task.eval_records()]

    def encode(rec: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        ids, mask = [], []
        for text, trained in demonstration(rec):
            piece = tok.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(trained)] * len(piece)
        return tok.encode(rec["prompt"], add_special_tokens=False), ids + [tok.eos_token_id], mask + [1]
    demos = [encode(r) for r in records[:4096]]

    def sft(n: int, rng: random.Random) -> list[tuple[list[int], list[int], list[int]]]:
        return rng.choices(demos, k=n)
    return RunData(train, evals, sft)


def _eval_record(r: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_ids": [int(x) for x in r["prompt_ids"]], "answer": r["answer"], "prompt": r["prompt"],
            "metadata": r["metadata"]}


def build_prompt_data(cfg: Any, model_path: str) -> RunData:
    """``cfg`` is the run's RunConfig; the tokenizer is the model's."""
    from ..models.loading import load_tokenizer

    tok = load_tokenizer(model_path)
    seed = cfg.data.seed if cfg.data.seed >= 0 else cfg.trainer.seed
    d = dataclasses.replace(cfg.data, seed=seed)
    if d.task == "addition":
        task = AdditionTask(seed=seed, num_eval=d.num_eval)
        train = addition_dataset(tok, task, dataclasses.replace(d, path=BUILTIN_ADDITION))
        evals = [{"prompt_ids": tok.encode(r["prompt"], add_special_tokens=False), "answer": r["answer"],
                  "prompt": r["prompt"]} for r in task.eval_records()]
        pairs = [(tok.encode(r["prompt"], add_special_tokens=False),
                  tok.encode(r["answer"], add_special_tokens=False) + [tok.eos_token_id])
                 for r in task.all_train_records()]

        def sft(n: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
            return rng.choices(pairs, k=n)
        return RunData(train, evals, sft)
    if d.task == "calc":
        return _calc_data(d, tok, seed)
    train = PromptDataset(d, tok)
    if d.eval_path:
        ev = PromptDataset(dataclasses.replace(d, path=d.eval_path, shuffle=False), tok)
        evals = [_eval_record(r) for r in ev.take(min(len(ev), d.num_eval))]
    else:
        evals = [_eval_record(r) for r in PromptDataset(dataclasses.replace(d, shuffle=False), tok).take(
                     min(len(train), d.num_eval))]
    return RunData(train, evals, None, train.num_filtered)
