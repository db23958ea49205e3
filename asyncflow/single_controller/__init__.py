"""Single controller: one driver (asyncio) calls SPMD worker groups over ZMQ.

docs/architecture.md describes the processes. Worker methods are plain Python marked with
``@register(Dispatch.X)``; the driver gets a ``WorkerGroup`` whose methods are coroutines.
"""
from typing import Any

from .dispatch import DISPATCH_MODES, Dispatch, DispatchMode, register, register_dispatch_mode
from .driver import Driver, DriverConfig, GroupSpec
from .errors import LaunchError, WorkerCallTimeout, WorkerDiedError, WorkerError
from .layout import GroupLayout
from .placement import RolePlacement
from .protocol import Group
from .runtime import RuntimeConfig
from .worker import Worker
from .worker_group import WorkerGroup


def __getattr__(name: str) -> Any:  # launch is imported lazily: `python -m ...launch` must not find it loaded
    if name in ("LaunchConfig", "launch_local", "run_rank"):
        from . import launch
        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Dispatch", "DispatchMode", "DISPATCH_MODES", "register", "register_dispatch_mode", "Driver", "DriverConfig",
    "GroupSpec", "Group", "WorkerGroup", "Worker", "GroupLayout", "RolePlacement", "LaunchConfig", "RuntimeConfig",
    "launch_local", "run_rank", "LaunchError", "WorkerError", "WorkerCallTimeout", "WorkerDiedError",
]
