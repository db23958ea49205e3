"""What every config section builds on: the error, the string setting with choices, and the
rule rows the sections' ``validate()`` check."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import field, fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    pass


def one_of(*choices: str, default: str) -> Any:
    """A string setting limited to ``choices`` (checked when the config loads, by choice_error).
    Not a ``Literal``: omegaconf 2.3 (the newest that hydra-core 1.3, and so verl, installs
    beside) refuses Literal annotations; the value stays a plain str."""
    assert default in choices, (default, choices)
    return field(default=default, metadata={"choices": choices})


def choice_error(merged: Any, section: Any, prefix: str = "") -> str | None:
    """The first setting with choices (``one_of``, or a field whose metadata names its
    ``choices``) of the merged config whose value is not among them, as omegaconf 2.4 words a
    Literal's refusal ("config key 'workflow.mode': Invalid value ...")."""
    for f in fields(section):
        value = getattr(section, f.name)
        if "choices" in f.metadata:
            got, choices = merged[f.name], list(f.metadata["choices"])
            if got not in choices:
                return f"config key '{prefix}{f.name}': Invalid value {got!r}, expected one of {choices}"
        elif is_dataclass(value):
            error = choice_error(merged[f.name], value, f"{prefix}{f.name}.")
            if error:
                return error
    return None


def rule_problems(rows: Iterable[tuple[str, Any, bool, str]]) -> list[str]:
    """``key: must be <rule>, got <value>`` for each (key, value, holds, rule) row that fails."""
    return [f"{key}: must be {rule}, got {value}" for key, value, ok, rule in rows if not ok]
