"""Fields of a prompt record by key: a top-level name, or a dotted path into nested records.

``reward_model.ground_truth`` reads ``row["reward_model"]["ground_truth"]``; a top-level field
whose name itself has a dot is taken first. verl's preprocessed files keep the answer there,
so with the default answer key (``answer``) a record without an ``answer`` field but with
``reward_model.ground_truth`` is read from it (verl's layout, recognised with no keys given).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_ANSWER_KEY", "VERL_ANSWER_KEY", "FieldError", "answer_key_of", "get_field", "has_field"]

DEFAULT_ANSWER_KEY = "answer"  # DataConfig.answer_key's default
VERL_ANSWER_KEY = "reward_model.ground_truth"  # where verl's preprocessing scripts put the answer


class FieldError(KeyError):
    """A key that does not resolve in a record; ``str()`` says which part is missing."""

    def __str__(self) -> str:
        return str(self.args[0])


def _fields(record: dict) -> str:
    return str(sorted(record, key=str))


def get_field(row: dict, key: str) -> Any:
    """The value under ``key`` (a field name, or a dotted path through nested records)."""
    if key in row:
        return row[key]
    if "." not in key:
        raise FieldError(f"missing field {key!r} (fields present: {_fields(row)})")
    node: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(node, dict):
            raise FieldError(f"missing field {key!r}: {'.'.join(walked)!r} is a {type(node).__name__}, not a "
                             f"record with field {part!r}")
        if part not in node:
            where = f"{'.'.join(walked)!r} has fields {_fields(node)}" if walked else \
                f"no field {part!r}; fields present: {_fields(node)}"
            raise FieldError(f"missing field {key!r} ({where})")
        node = node[part]
        walked.append(part)
    return node


def has_field(row: dict, key: str) -> bool:
    try:
        get_field(row, key)
    except FieldError:
        return False
    return True


def answer_key_of(row: dict, key: str) -> str:
    """The key the answer is read from: ``key``, or verl's ``reward_model.ground_truth`` when
    ``key`` is the default and the record has no such field but has verl's."""
    if key == DEFAULT_ANSWER_KEY and key not in row and has_field(row, VERL_ANSWER_KEY):
        return VERL_ANSWER_KEY
    return key
