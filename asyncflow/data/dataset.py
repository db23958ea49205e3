"""Prompts with verifiable answers, from local .jsonl / .json / .parquet files or the
built-in addition task, as an endless, seeded, resumable stream.

Every prompt is tokenized once up front, so a bad row fails at start-up (naming
file, row and field), not hours into a run. Prompts over the token limit are
dropped and counted, never truncated: a truncated math problem has a wrong answer.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import DataConfig  # the config tree's data section is what the dataset reads
from asyncflow.data.addition import AdditionTask
from asyncflow.data.chat import apply_chat_template
from asyncflow.data.fields import FieldError, answer_key_of, get_field

__all__ = ["BUILTIN_ADDITION", "DataConfig", "DataError", "PromptDataset", "addition_dataset", "load_prompt_dataset"]

log = logging.getLogger(__name__)

# DataConfig.path naming the built-in task instead of a file.
BUILTIN_ADDITION = "builtin:addition"


class DataError(ValueError):
    """A data file or record cannot be used; the message names file, row and field."""


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) pairs; `where` says how to find the row ("line 3", "row 3")."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline) are not records
                try:
                    yield f"line {lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}, line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from exc
        if not isinstance(rows, list):
            raise DataError(f"{path}: holds a JSON {type(rows).__name__}; expected a list of records (or use .jsonl)")
        for i, row in enumerate(rows, start=1):
            yield f"item {i}", row
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency, only for parquet files
        except ImportError as exc:
            raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from exc
        for i, row in enumerate(pq.read_table(str(path)).to_pylist(), start=1):
            yield f"row {i}", row
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .jsonl, .json or .parquet")


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict[str, str]]:
    """A prompt is a non-empty string, or a non-empty list of {"role", "content"} messages."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field {key!r} is an empty prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(
                    f"{where}: field {key!r} message {j} is {m!r}; expected {{'role': str, 'content': str}}"
                )
        return prompt
    if isinstance(prompt, list):
        raise DataError(f"{where}: field {key!r} is an empty message list")
    raise DataError(
        f"{where}: field {key!r} has type {type(prompt).__name__}; expected a string or a list of chat messages"
    )


def _parse_row(row: Any, where: str, config: DataConfig) -> tuple[str | list, str, dict[str, Any]]:
    """(prompt, answer, metadata) of a record. Keys may be dotted paths into nested records
    (``data.answer_key=reward_model.ground_truth``); verl's layout needs no keys (fields.py).
    The record's other top-level fields become its metadata, for rewards and logs."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: record is a {type(row).__name__}; expected a JSON object")
    answer_key = answer_key_of(row, config.answer_key)
    values = []
    for key, setting in ((config.prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        try:
            values.append(get_field(row, key))
        except FieldError as exc:
            raise DataError(f"{where}: {exc}; set {setting} if your file names it differently "
                            f"(a dotted path reaches into nested fields)") from None
    prompt = _check_prompt(values[0], where, config.prompt_key)
    answer = values[1]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(
            f"{where}: field {answer_key!r} has type {type(answer).__name__}; expected a string or a number"
        )
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: field 'metadata' has type {type(metadata).__name__}; expected an object")
    # Other columns (level, source, verl's data_source, ability, extra_info, ...) travel along for
    # rewards and logs; a field read through a dotted path leaves its parent record there.
    extra = {k: v for k, v in row.items() if k not in (config.prompt_key, answer_key, "metadata")}
    return prompt, str(answer), {**extra, **metadata}


class PromptDataset:
    """Tokenized prompts, iterated endlessly: each epoch a seeded shuffle of all kept
    records. `state_dict()` records (epoch, position) so a resumed run yields exactly
    the prompt that would have come next.

    A yielded record: {"prompt_ids": LongTensor[T], "prompt": str (the text tokenized, after
    any chat template), "answer": str, "index": int, "metadata": dict}; `index` is the record's
    0-based position in the source.
    """

    def __init__(self, config: DataConfig, tokenizer: Any) -> None:
        path = Path(config.path).expanduser()
        if not path.is_file():
            raise DataError(f"PromptDataset: data file {path} does not exist (DataConfig.path)")
        rows = (
            (f"{path}, {where}", _parse_row(row, f"{path}, {where}", config)) for where, row in read_records(path)
        )
        self._setup(rows, tokenizer, config, source=str(path))

    @classmethod
    def from_records(
        cls, records: Iterable[dict[str, Any]], tokenizer: Any, config: DataConfig, source: str = "records"
    ) -> PromptDataset:
        """A dataset over in-memory records (same fields and checks as a file)."""
        self = cls.__new__(cls)
        rows = (
            (f"{source}, record {i}", _parse_row(r, f"{source}, record {i}", config))
            for i, r in enumerate(records, start=1)
        )
        self._setup(rows, tokenizer, config, source=source)
        return self

    def _setup(self, rows: Iterable[tuple[str, tuple]], tokenizer: Any, config: DataConfig, source: str) -> None:
        self.config = config
        self.source = source
        wheres, texts, answers, metas, templated = [], [], [], [], []
        for where, (prompt, answer, meta) in rows:
            use_template = config.chat_template or isinstance(prompt, list)  # messages need a template
            texts.append(apply_chat_template(tokenizer, prompt, config.system_prompt or None)
                         if use_template else prompt)
            templated.append(use_template)
            wheres.append(where)
            answers.append(answer)
            metas.append(meta)
        if not texts:
            raise DataError(f"{source}: no records (empty file?)")
        ids = self._tokenize(tokenizer, texts, templated)

        self._ids: list[list[int]] = []
        self._texts: list[str] = []
        self._answers: list[str] = []
        self._meta: list[dict[str, Any]] = []
        self._index: list[int] = []
        self.filtered_indices: list[int] = []  # source positions of prompts over the limit
        for i, (where, row_ids) in enumerate(zip(wheres, ids)):
            if not row_ids:
                raise DataError(f"{where}: prompt tokenizes to no tokens (characters the tokenizer drops?)")
            if len(row_ids) > config.max_prompt_tokens:
                self.filtered_indices.append(i)
                continue
            self._ids.append(row_ids)
            self._texts.append(texts[i])
            self._answers.append(answers[i])
            self._meta.append(metas[i])
            self._index.append(i)
        self.num_filtered = len(self.filtered_indices)
        if self.num_filtered:
            log.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_tokens=%d",
                source, self.num_filtered, len(texts), config.max_prompt_tokens,
            )
        if not self._ids:
            raise DataError(
                f"{source}: all {len(texts)} prompts are longer than max_prompt_tokens={config.max_prompt_tokens}; "
                f"raise DataConfig.max_prompt_tokens"
            )
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @staticmethod
    def _tokenize(tokenizer: Any, texts: list[str], templated: list[bool]) -> list[list[int]]:
        # Chat templates already add any BOS they want; plain text gets the tokenizer's specials.
        out: list[list[int]] = [[] for _ in texts]
        for flag in (True, False):
            idx = [i for i, t in enumerate(templated) if t == flag]
            if idx:
                enc = tokenizer([texts[i] for i in idx], add_special_tokens=not flag)["input_ids"]
                for i, row in zip(idx, enc):
                    out[i] = list(row)
        return out

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, k: int) -> dict[str, Any]:
        """The k-th kept record, in source order."""
        return {
            "prompt_ids": torch.tensor(self._ids[k], dtype=torch.long),
            "prompt": self._texts[k],
            "answer": self._answers[k],
            "index": self._index[k],
            "metadata": dict(self._meta[k]),
        }

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self._ids)))
            if self.config.shuffle:
                random.Random(f"prompts:{self.config.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def __iter__(self) -> PromptDataset:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._position >= len(self._ids):
            self._epoch += 1
            self._position = 0
        k = self._epoch_order(self._epoch)[self._position]
        self._position += 1
        return self[k]

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next n records of the stream."""
        return [next(self) for _ in range(n)]

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "num_records": len(self._ids),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was taken; the data and its order must be the same."""
        expected = {"seed": self.config.seed, "shuffle": self.config.shuffle, "num_records": len(self._ids)}
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"{self.source}: cannot resume: checkpoint has {key}={state[key]!r} but the dataset has "
                    f"{value!r}; the data or its config changed since the checkpoint"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._ids):
            raise DataError(f"{self.source}: bad data state epoch={epoch}, position={position}")
        self._epoch, self._position = epoch, position


def addition_dataset(
    tokenizer: Any, task: AdditionTask | None = None, config: DataConfig | None = None
) -> PromptDataset:
    """The built-in task's training prompts (held-out pairs excluded) as a PromptDataset,
    so the trainer reads it exactly like a file. `index` is the pair's id."""
    task = task or AdditionTask()
    config = config or DataConfig(path=BUILTIN_ADDITION)
    ds = PromptDataset.from_records(task.all_train_records(), tokenizer, config, source=BUILTIN_ADDITION)
    # Record positions are 0..N-1 over the training pairs; report the pair id instead.
    ds._index = [ds._meta[k].pop("index") for k in range(len(ds))]
    return ds


def load_prompt_dataset(config: DataConfig, tokenizer: Any, addition_eval_size: int = 256) -> PromptDataset:
    """A file dataset, or the addition task when config.path is "builtin:addition"
    (its held-out set is chosen by config.seed)."""
    if str(config.path) == BUILTIN_ADDITION:
        return addition_dataset(tokenizer, AdditionTask(seed=config.seed, num_eval=addition_eval_size), config)
    return PromptDataset(config, tokenizer)
