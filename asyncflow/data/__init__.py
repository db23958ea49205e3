"""Prompt data: the built-in addition task and prompt files (.jsonl / .json / .parquet).

Importing this package does not import transformers; the tokenizer is passed in.
"""

from asyncflow.data.addition import AdditionTask, addition_record
from asyncflow.data.chat import apply_chat_template, default_chat_text, to_messages
from asyncflow.data.dataset import (
    BUILTIN_ADDITION,
    DataConfig,
    DataError,
    PromptDataset,
    addition_dataset,
    load_prompt_dataset,
)

__all__ = [
    "BUILTIN_ADDITION",
    "AdditionTask",
    "DataConfig",
    "DataError",
    "PromptDataset",
    "addition_dataset",
    "addition_record",
    "apply_chat_template",
    "default_chat_text",
    "load_prompt_dataset",
    "to_messages",
]
