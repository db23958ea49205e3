"""Errors of the single controller. Each names the rank, role and method it concerns."""
from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised; the message carries the remote traceback."""

    def __init__(self, msg: str, *, rank: int = -1, role: str = "", method: str = "", remote_tb: str = ""):
        super().__init__(msg)
        self.rank, self.role, self.method, self.remote_tb = rank, role, method, remote_tb


class WorkerCallTimeout(WorkerError, TimeoutError):
    """A call got no reply within its timeout (the worker may still be running it)."""


class WorkerDiedError(WorkerError):
    """A worker stopped answering heartbeats: its process died or hangs."""


class LaunchError(RuntimeError):
    """Rendezvous or start-up failed (addresses never published, bad placement, ...)."""
