"""What the driver's code (the workflow executor, the training loop, weight sync) needs of a
worker group, as a Protocol: ``WorkerGroup`` is the implementation; a stand-in (a test's, a
simulation's) only has to match it to be passed where a group is expected."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .worker_group import WorkerGroup

__all__ = ["Group"]


class Group(Protocol):
    """A role's ranks, and its methods marked with ``@register`` as coroutines: ``await
    group.generate(meta)`` calls every rank the method's dispatch mode picks and returns what
    that mode gathers. Which methods a group has depends on its worker class, so they are
    looked up by name (``__getattr__``) and typed ``Any``."""

    @property
    def role(self) -> str: ...

    @property
    def ranks(self) -> list[int]: ...

    def __getattr__(self, name: str) -> Any: ...


if TYPE_CHECKING:
    def _worker_group_conforms(g: WorkerGroup) -> Group:
        """mypy checks here that WorkerGroup implements Group (never called)."""
        return g
