"""Errors of the RPC layer, and the names by which errors travel back to a caller.

A server that fails a call replies with the error's class name, message and traceback;
the caller raises it as the class registered under that name (``ERROR_TYPES``), so it can
be caught precisely, or as :class:`RemoteError` when the name is not registered. The
services built on this layer register their own errors (``register_error_types``):
``asyncflow.transfer_queue.errors`` registers the TransferQueue's.
"""
from __future__ import annotations


class RpcError(RuntimeError):
    """Base class of the RPC layer's own errors."""


class RpcTimeout(RpcError, TimeoutError):
    """A call got no reply within its timeout (or a local call ran past it).

    A client may be given a subclass to raise instead (``timeout_error=``): the
    TransferQueue's clients raise ``TransferQueueTimeout``, which is one."""


class RemoteError(RpcError):
    """An unexpected exception inside a remote service; carries the remote traceback."""


ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (RpcError, RpcTimeout, RemoteError, ValueError, TypeError, KeyError)
}
"""Error classes a reply may name, by class name: raised by the caller as that class."""


def register_error_types(*classes: type[Exception]) -> None:
    """Let replies name these classes: a caller then raises the same class. A name is
    registered once: another class under a name already taken is a ValueError (two
    services would otherwise decide which class the other's callers see)."""
    for cls in classes:
        have = ERROR_TYPES.get(cls.__name__)
        if have is not None and have is not cls:
            raise ValueError(f"an error named {cls.__name__!r} is already registered "
                             f"({have.__module__}.{have.__qualname__}); cannot also register "
                             f"{cls.__module__}.{cls.__qualname__}")
        ERROR_TYPES[cls.__name__] = cls
