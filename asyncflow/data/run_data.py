"""A run's prompt data from its config: training stream, held-out set, warm-up examples."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.loading import load_tokenizer
from ..rewards.data_source import SCORERS, unrouted
from .addition import AdditionTask
from .calc import CalcTask, demonstration
from .dataset import BUILTIN_ADDITION, DataError, PromptDataset, addition_dataset

log = logging.getLogger(__name__)


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


def model_context(model_path: str) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its config.json), or None."""
    try:
        n = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


def prompt_room(cfg: Any, model_path: str) -> int | None:
    """The longest prompt a rollout request can take: the model's context (and
    ``rollout.max_kv_tokens`` when set) less ``rollout.max_new_tokens``; None when unbounded.
    A budget that leaves no room at all is a DataError."""
    limits = [n for n in (model_context(model_path), cfg.rollout.max_kv_tokens) if n]
    if not limits:
        return None
    room = min(limits) - cfg.rollout.max_new_tokens
    if room < 1:
        raise DataError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: leaves no room for a prompt in the "
                        f"model's context of {min(limits)} tokens (max_position_embeddings in "
                        f"{model_path}/config.json, or rollout.max_kv_tokens); lower it")
    return room


def _fit_prompts(d: Any, room: int | None) -> Any:
    """A prompt file's limit lowered to what leaves room for the budget: such prompts are dropped
    and counted like those over ``data.max_prompt_tokens``, instead of failing at the rollout."""
    if room is None or room >= d.max_prompt_tokens:
        return d
    # Said once at start; the dataset warns only if prompts are in fact dropped, with this limit.
    log.info("data: prompts over %d tokens are dropped (data.max_prompt_tokens=%d, but the model's context "
             "less rollout.max_new_tokens leaves %d)", room, d.max_prompt_tokens, room)
    return dataclasses.replace(d, max_prompt_tokens=room)


def _check_room(train: PromptDataset, room: int | None, cfg: Any) -> None:
    longest = max(map(len, train._ids), default=0)
    if room is not None and longest > room:
        raise DataError(f"data.task={cfg.data.task}: its longest prompt has {longest} tokens, and the model's "
                        f"context less rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves {room}; "
                        "lower rollout.max_new_tokens")


def _check_reward_fits(cfg: Any, datasets: list[PromptDataset]) -> None:
    """A prompt file's records against the run's reward, at start: with ``reward.name=data_source``
    every kept record's data_source needs a rule (else the first such record is named); a file
    in verl's layout scored by the default ``number`` rule is warned about."""
    r = cfg.reward
    if r.custom_path:
        return
    if r.name == "data_source":
        for ds in datasets:
            for k, meta in enumerate(ds._meta):
                if unrouted([meta.get("data_source")]):
                    what = f"data_source {meta['data_source']!r}" if "data_source" in meta else "no data_source"
                    raise DataError(f"{ds.source}, record {ds._index[k] + 1}: {what}, and reward.name=data_source "
                                    f"has rules for {', '.join(SCORERS)} only; give the set's own function with "
                                    "reward.custom_path (and reward.custom_name)")
    elif r.name == "number" and datasets and all("data_source" in m and isinstance(m.get("reward_model"), dict)
                                                 for m in datasets[0]._meta):
        log.warning("%s is in verl's layout (data_source, reward_model.ground_truth), scored with reward.name=number "
                    "(a response that is one number equal to the answer); verl's default scorer is "
                    "reward.name=data_source, a verl reward file is reward.custom_path", datasets[0].source)


def build_prompt_data(cfg: Any, model_path: str) -> RunData:
    """``cfg`` is the run's RunConfig; the tokenizer is the model's. Every prompt leaves room
    for ``rollout.max_new_tokens`` in the model's context: a prompt file's longer prompts are
    dropped (counted), a built-in task whose prompts do not fit is refused."""
    tok = load_tokenizer(model_path)
    seed = cfg.data.seed if cfg.data.seed >= 0 else cfg.trainer.seed
    d = dataclasses.replace(cfg.data, seed=seed)
    room = prompt_room(cfg, model_path)
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
        _check_room(train, room, cfg)
        return RunData(train, evals, sft)
    if d.task == "calc":
        data = _calc_data(d, tok, seed)
        _check_room(data.train, room, cfg)
        return data
    d = _fit_prompts(d, room)
    train = PromptDataset(d, tok)
    if d.eval_path:
        ev = PromptDataset(dataclasses.replace(d, path=d.eval_path, shuffle=False), tok)
        _check_reward_fits(cfg, [train, ev])
        evals = [_eval_record(r) for r in ev.take(min(len(ev), d.num_eval))]
    else:
        _check_reward_fits(cfg, [train])
        evals = [_eval_record(r) for r in PromptDataset(dataclasses.replace(d, shuffle=False), tok).take(
                     min(len(train), d.num_eval))]
    return RunData(train, evals, None, train.num_filtered)
