"""What the executor asks the policy's ranks to train on: one step's update.

The executor sends it with the update stage's call (``update(step, request, io)``); each rank
of the group reads its own share of the step's rows from the TransferQueue. Worker calls
carry JSON values and tensors only (asyncflow.single_controller.wire), so the request
crosses as ``to_wire()``'s dict and the worker rebuilds it with ``from_wire``, which checks
every field and names the one that is wrong.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["UpdateRequest"]


@dataclass(frozen=True)
class UpdateRequest:
    partition: str  # the step's TransferQueue partition
    task: str  # the update stage's name: the TransferQueue task that consumes the rows
    rows: int  # rows the step trains on, across every rank of the group
    timeout_s: float  # how long a rank waits for the rows

    def __post_init__(self) -> None:
        _check(self.partition, "partition", str, "a str")
        _check(self.task, "task", str, "a str")
        _check(self.rows, "rows", int, "an int")
        if self.rows < 0:
            raise ValueError(f"update request: field 'rows' must be >= 0, got {self.rows}")
        _check(self.timeout_s, "timeout_s", (int, float), "a number")
        if not self.timeout_s > 0:
            raise ValueError(f"update request: field 'timeout_s' must be > 0, got {self.timeout_s}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))  # an int off the wire is a float here

    def to_wire(self) -> dict[str, Any]:
        return {"partition": self.partition, "task": self.task, "rows": self.rows, "timeout_s": self.timeout_s}

    @staticmethod
    def from_wire(w: Any) -> UpdateRequest:
        """The request a worker received; ValueError naming the field that is missing,
        unknown or of the wrong type."""
        if isinstance(w, UpdateRequest):  # an in-process call hands the dataclass itself
            return w
        if not isinstance(w, Mapping):
            raise ValueError(f"update request: expected a dict of its fields, got {type(w).__name__}")
        names = [f.name for f in fields(UpdateRequest)]
        missing = [n for n in names if n not in w]
        if missing:
            raise ValueError(f"update request: missing field {missing[0]!r} (fields present: {sorted(w)})")
        unknown = sorted(str(k) for k in w if k not in names)
        if unknown:
            raise ValueError(f"update request: unknown field {unknown[0]!r} (fields: {names})")
        return UpdateRequest(w["partition"], w["task"], w["rows"], w["timeout_s"])


def _check(value: Any, name: str, kind: type | tuple[type, ...], what: str) -> None:
    # bool is an int to Python, never a row count or a timeout
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"update request: field {name!r} must be {what}, got {type(value).__name__} {value!r}")
