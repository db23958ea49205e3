"""What a recipe declares: its roles (worker classes and where they run) and its stages.
The executor turns the stages into one asyncio task each; the trainer starts the roles.

A stage names the role that runs it (a worker group, or ``"driver"`` for a plain function
run in the driver), the method or function, the columns it reads (a row is ready for the
stage once all of them are written) and the columns it writes, and how many rows it takes
per call. Overlap between stages follows from these data dependencies alone.

Workers receive the columns their stage declared (``StageIO``) with every call, so one
worker method serves stages of other column names (a reference model and the actor both
compute log-probs; a second rollout stage writes a baseline's responses).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import column_names as col

if TYPE_CHECKING:
    from ..transfer_queue.samplers import SamplerSpec

KINDS = ("map", "rollout", "filter", "update")
DRIVER = "driver"  # the role of a stage that runs a plain function in the driver
SIDES = ("actor", "rollout", "all")


@dataclass
class StageIO:
    """The columns a stage reads and writes, and its options, as a worker receives them."""
    inputs: list[str]
    outputs: list[str]
    options: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs), "options": dict(self.options)}

    @staticmethod
    def of(x: StageIO | dict[str, Any] | None, inputs: Sequence[str] = (), outputs: Sequence[str] = ()) -> StageIO:
        """``x`` (what a worker method receives as ``io``) as a StageIO; None (a direct call,
        no stage): the method's own default column names ``inputs`` and ``outputs``."""
        if x is None:
            return StageIO(list(inputs), list(outputs))
        if isinstance(x, StageIO):
            return x
        return StageIO(list(x["inputs"]), list(x["outputs"]), dict(x.get("options") or {}))


@dataclass
class Stage:
    name: str  # also the TransferQueue task name: each stage consumes every row once
    role: str  # worker group role, or "driver" (``fn`` runs in the driver)
    method: str  # the worker method (registered with a dispatch mode); "" for a driver stage
    inputs: list[str]
    outputs: list[str] = field(default_factory=list)
    # rows per call in stream/async mode (0: the whole step; a map or filter stage takes at least
    # this many, and every row of the step ready by then); sync: always the whole step
    batch_rows: int = 0
    sampler: SamplerSpec = "sequential"
    kind: str = "map"  # map | rollout (gated by weights version) | filter (keeps or drops groups) | update
    on_policy_weights: bool = False  # map stage on the policy: needs the weights of the step's version
    options: dict[str, Any] = field(default_factory=dict)  # handed to the worker method with the columns
    # Driver stage: fn(batch: DriverBatch) -> {output column: values} (map), or a bool tensor
    # with one entry per row, True for the rows to keep (filter; whole groups at a time).
    fn: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"stage {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.inputs:
            raise ValueError(f"stage {self.name!r}: a stage needs at least one input column")
        if self.role == DRIVER and not callable(self.fn):
            raise ValueError(f"stage {self.name!r}: a driver stage needs a function (fn=...)")
        if self.role != DRIVER and self.fn is not None:
            raise ValueError(f"stage {self.name!r}: fn is for driver stages (role={DRIVER!r}); "
                             f"role {self.role!r} runs the worker method {self.method!r}")
        if self.kind == "filter" and self.role != DRIVER:
            raise ValueError(f"stage {self.name!r}: a filter stage runs in the driver (role={DRIVER!r}, fn=...)")

    @property
    def io(self) -> StageIO:
        return StageIO(list(self.inputs), list(self.outputs), dict(self.options))


@dataclass
class Role:
    """A worker class and the ranks it runs on.

    on: the placement side whose ranks it shares ("actor": the training ranks, "rollout":
    the generation ranks, "all"), or explicit ranks. per_rank: one group per rank, each a
    rollout instance that swaps weights on its own. options: extra keyword arguments of the
    worker's ``__init__`` besides the run's config.
    """
    worker: type | str  # the class, or "package.module:Class"
    on: str | list[int] = "actor"
    per_rank: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def worker_class(self) -> type:
        if isinstance(self.worker, type):
            return self.worker
        mod, _, name = str(self.worker).partition(":")
        if not mod or not name:
            raise ValueError(f"worker {self.worker!r}: expected a class or 'package.module:Class'")
        try:
            obj: Any = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"worker {self.worker!r}: cannot import module {mod!r}: {e}") from e
        for part in name.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"worker {self.worker!r}: module {mod!r} has no class {name!r}")
            obj = getattr(obj, part)
        if not isinstance(obj, type):
            raise ValueError(f"worker {self.worker!r}: {name!r} is not a class")
        return obj


@dataclass
class RecipeSpec:
    """A recipe's whole declaration: ``build(cfg)`` in its ``recipe.py`` returns one."""
    roles: dict[str, Role]
    stages: list[Stage]

    @property
    def update(self) -> Stage:
        return next(s for s in self.stages if s.kind == "update")

    @property
    def policy(self) -> str:
        """The role whose weights the rollout serves: the one that runs the update."""
        return self.update.role

    @property
    def rollout_role(self) -> str | None:
        return next((s.role for s in self.stages if s.kind == "rollout"), None)


@dataclass
class DriverBatch:
    """What a driver stage's function receives: the step's rows it was given, their columns
    (fixed columns as tensors [rows], jagged ones as a list of 1-D tensors, object columns
    as lists), the group (prompt uid) of each row, and the stage's options."""
    step: int
    columns: dict[str, Any]
    groups: list[int]
    options: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.groups)


def upstream_columns(stages: Sequence[Stage], stage: Stage) -> set[str]:
    """The columns ``stage``'s inputs depend on, its inputs included: the inputs of every stage
    that writes one of them, and so on back to the source. A row ready for ``stage`` has them
    all written."""
    writer = {c: s for s in stages for c in s.outputs}
    seen: set[str] = set()
    todo = list(stage.inputs)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            if c in writer:
                todo.extend(writer[c].inputs)
    return seen


def check_graph(stages: list[Stage], source_columns: list[str], where: str = "recipe") -> None:
    """Every input is written by the source or by an earlier stage, one writer per column,
    one update stage, last. ``where`` names the recipe file in the errors."""
    have = dict.fromkeys(source_columns, "the prompt source")
    names = set()
    for s in stages:
        if s.name in names:
            raise ValueError(f"{where}: stage name {s.name!r} repeats: stage names are TransferQueue task names")
        names.add(s.name)
        missing = [c for c in s.inputs if c not in have]
        if missing:
            raise ValueError(f"{where}: stage {s.name!r} reads {missing}, which neither the prompt source "
                             f"({source_columns}) nor an earlier stage writes")
        for c in s.outputs:
            if c in have:
                raise ValueError(f"{where}: stage {s.name!r} writes column {c!r}, which {have[c]} already "
                                 "writes: a column has one writer (name the new one differently)")
            have[c] = f"stage {s.name!r}"
    _check_gates(stages, where)
    _check_loss_mask(stages, where)
    updates = [s.name for s in stages if s.kind == "update"]
    if len(updates) != 1 or stages[-1].kind != "update":
        raise ValueError(f"{where}: a recipe needs exactly one update stage, last; got update stages {updates}")


def _check_gates(stages: list[Stage], where: str) -> None:
    """At most one filter; every stage after it reads its gate column, directly or through a
    column written from gated rows (only the rows the filter kept reach those stages)."""
    filters = [i for i, s in enumerate(stages) if s.kind == "filter"]
    if len(filters) > 1:
        raise ValueError(f"{where}: filter stages {[stages[i].name for i in filters]}: a recipe has one filter")
    if not filters:
        return
    f = stages[filters[0]]
    if len(f.outputs) != 1:
        raise ValueError(f"{where}: filter stage {f.name!r} writes one gate column (the kept rows get it); "
                         f"it declares {f.outputs}")
    gated = set(f.outputs)
    for s in stages[filters[0] + 1:]:
        if not gated & set(s.inputs):
            raise ValueError(f"{where}: stage {s.name!r} comes after the filter {f.name!r} but reads none of "
                             f"{sorted(gated)}: add {f.outputs[0]!r} to its inputs, so it waits for the "
                             "filter's decision and sees only the kept rows")
        gated.update(s.outputs)


def _check_loss_mask(stages: list[Stage], where: str) -> None:
    """Rows with a loss mask (episodes: tool text in the response) must be trained by it: the
    stages that compute advantages and the update read it, or tool text would be trained as
    the model's own."""
    if not any(col.LOSS_MASK in s.outputs for s in stages):
        return
    for s in stages:
        if (s.kind == "update" or col.ADVANTAGES in s.outputs) and col.LOSS_MASK not in s.inputs:
            raise ValueError(f"{where}: stage {s.name!r} must read 'loss_mask' (a stage writes it: the rows hold "
                             "text the model did not write, which must not be trained)")


def check_roles(spec: RecipeSpec, where: str = "recipe") -> None:
    """Every worker stage's role is declared with a class that has its method; the rollout
    stages' role runs per rank; every declared role is used."""
    for name, role in spec.roles.items():
        if name == DRIVER:
            raise ValueError(f"{where}: {DRIVER!r} is the role of driver stages, not a worker role")
        try:
            role.worker_class()
        except ValueError as e:
            raise ValueError(f"{where}: role {name!r}: {e}") from None
        if isinstance(role.on, str) and role.on not in SIDES:
            hint = (" (placement.reward_with=inline has no reward role: the rollout scores its rows; build the "
                     "stages with recipes.grpo.recipe.scored_rollout)" if role.on == "inline" else "")
            raise ValueError(f"{where}: role {name!r}: on={role.on!r}; expected one of {SIDES} or a list of "
                             f"ranks{hint}")
        if not isinstance(role.on, str) and not list(role.on):
            raise ValueError(f"{where}: role {name!r} has no ranks (on=[]): give it at least one rank")
    used = set()
    for s in spec.stages:
        if s.role == DRIVER:
            continue
        used.add(s.role)
        stage_role = spec.roles.get(s.role)
        if stage_role is None:
            raise ValueError(f"{where}: stage {s.name!r} runs on role {s.role!r}, which the recipe does not "
                             f"declare; declared roles: {sorted(spec.roles)}")
        cls = stage_role.worker_class()
        if not callable(getattr(cls, s.method, None)):
            raise ValueError(f"{where}: stage {s.name!r} calls {s.method!r}, which worker class "
                             f"{cls.__module__}.{cls.__qualname__} of role {s.role!r} does not define")
        if s.kind == "rollout" and not stage_role.per_rank:
            raise ValueError(f"{where}: rollout stage {s.name!r} runs on role {s.role!r}, which must be "
                             "declared per_rank=True (each rollout instance swaps weights on its own)")
    for s in spec.stages:
        if s.kind == "rollout" and s.options.get("episode"):
            # a wrong path fails here, not on a worker mid-run; lazy: agents.runner imports torch, and
            # `import asyncflow.cli` reads this module (the recipe listing)
            from ..agents.runner import load_episode
            try:
                load_episode(s.options["episode"])
            except ValueError as e:
                raise ValueError(f"{where}: stage {s.name!r}: {e}") from None
    rollout_roles = {s.role for s in spec.stages if s.kind == "rollout"}
    if len(rollout_roles) > 1:
        raise ValueError(f"{where}: rollout stages run on roles {sorted(rollout_roles)}: they share one role")
    unused = sorted(set(spec.roles) - used)
    if unused:
        raise ValueError(f"{where}: roles {unused} are declared but no stage runs on them")
