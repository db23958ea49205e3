"""What a recipe declares: its stages. The executor turns them into one asyncio task each.

A stage names the role (worker group) that runs it, the worker method, the columns it
reads (a row is ready for the stage once all of them are written) and writes, and how
many rows it takes per call. Overlap between stages follows from these data
dependencies alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("map", "rollout", "filter", "update")


@dataclass
class Stage:
    name: str  # also the TransferQueue task name: each stage consumes every row once
    role: str  # worker group role ("rollout" stages run on every rollout instance)
    method: str  # the worker method, registered with a dispatch mode
    inputs: list[str]
    outputs: list[str] = field(default_factory=list)
    batch_rows: int = 0  # rows per call in stream/async mode (0: the whole step); sync: always the whole step
    sampler: Any = "sequential"
    kind: str = "map"  # map | rollout (gated by weights version) | filter (driver-side) | update (whole step)
    on_policy_weights: bool = False  # map stage on the actor: needs the weights of the step's version

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"stage {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.inputs:
            raise ValueError(f"stage {self.name!r}: a stage needs at least one input column")


def check_graph(stages: list[Stage], source_columns: list[str]) -> None:
    """Every input is written by the source or by an earlier stage; one update stage."""
    have = set(source_columns)
    names = set()
    for s in stages:
        if s.name in names:
            raise ValueError(f"stage name {s.name!r} repeats: stage names are TransferQueue task names")
        names.add(s.name)
        missing = [c for c in s.inputs if c not in have]
        if missing:
            raise ValueError(f"stage {s.name!r} reads {missing}, which neither the prompt source "
                             f"({source_columns}) nor an earlier stage writes")
        have.update(s.outputs)
    updates = [s.name for s in stages if s.kind == "update"]
    if len(updates) != 1 or stages[-1].kind != "update":
        raise ValueError(f"a recipe needs exactly one update stage, last; got update stages {updates}")
