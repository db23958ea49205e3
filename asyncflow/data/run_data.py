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
    sft_examples: Callable[[int, random.Random], list[tuple[list[int], list[int]]]] | None
    filtered: int = 0

    def train_records(self) -> Iterator[dict[str, Any]]:
        return iter(self.train)


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
    train = PromptDataset(d, tok)
    if d.eval_path:
        ev = PromptDataset(dataclasses.replace(d, path=d.eval_path, shuffle=False), tok)
        evals = [_eval_record(r) for r in ev.take(min(len(ev), d.num_eval))]
    else:
        evals = [_eval_record(r) for r in PromptDataset(dataclasses.replace(d, shuffle=False), tok).take(
                     min(len(train), d.num_eval))]
    return RunData(train, evals, None, train.num_filtered)
