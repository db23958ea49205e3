"""Name -> function tables, so a recipe can choose each algorithm piece by a string.

A recipe (a YAML file or a CLI flag) says ``advantage: grpo`` or ``policy_loss: clip_higher``;
the trainer turns the string into a function here. A wrong name must fail at start-up with the
list of valid names, not deep inside a training step, hence ``get`` raises a ValueError that
lists what is registered.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """A table of interchangeable functions of one kind (e.g. advantage estimators)."""

    def __init__(self, kind: str) -> None:
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"Registry kind must be a non-empty string, got {kind!r}")
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering a function under ``name``; returns the function unchanged.

        Registering a different function under a taken name raises, so two modules cannot
        silently shadow each other. Re-registering the same function (same module and
        qualified name, as after ``importlib.reload``) replaces the entry.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            old = self._table.get(name)
            if old is not None and _ident(old) != _ident(fn):
                raise ValueError(f"{self.kind} {name!r} is already registered to {_ident(old)}; "
                                 f"cannot register {_ident(fn)} under the same name")
            self._table[name] = fn
            return fn

        return decorator

    def alias(self, name: str, existing: str) -> None:
        """Make ``name`` a second name of the function registered as ``existing`` (e.g. verl's
        name for one of ours). Both appear in ``names()``; a taken ``name`` raises unless it
        already refers to that same function. ``existing`` must be registered first."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        fn = self.get(existing)
        old = self._table.get(name)
        if old is not None and _ident(old) != _ident(fn):  # same ident: a module reload
            raise ValueError(f"{self.kind} {name!r} is already registered to {_ident(old)}; "
                             f"cannot make it an alias of {existing!r}")
        self._table[name] = fn

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError listing the valid names otherwise."""
        try:
            return self._table[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; registered: "
                             f"{', '.join(self.names()) or '(none)'}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def _ident(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
VALUE_LOSSES: Registry = Registry("value loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
AGGREGATIONS: Registry = Registry("loss aggregation")
