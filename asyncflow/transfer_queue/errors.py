"""Errors of the TransferQueue. Each names what was asked and what was wrong.

Errors raised inside a controller or storage unit travel back to the caller by name
and are raised there as the same class, so callers can catch them precisely: they are
registered with the RPC layer by name (``asyncflow.rpc.errors``) when this module is imported.
"""
from __future__ import annotations

# RemoteError belongs to the RPC layer (any service's call can fail so); re-exported here
# because ``asyncflow.transfer_queue.RemoteError`` is part of the TransferQueue's public API.
from ..rpc.errors import RemoteError, RpcTimeout, register_error_types


class TransferQueueError(RuntimeError):
    """Base class of every TransferQueue error."""


class _LookupByName(TransferQueueError, KeyError):
    """An error about a name that is not there; printed as its message (KeyError quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownPartitionError(_LookupByName):
    pass


class UnknownTaskError(_LookupByName):
    pass


class SchemaMismatchError(TransferQueueError, TypeError):
    """A column's kind, dtype or per-row shape differs from what the partition holds."""


class BadPutError(TransferQueueError, ValueError):
    """A put that cannot be stored as given (row counts, rows that do not exist, rewrites)."""


class RowsClearedError(TransferQueueError, LookupError):
    """A read of rows (or a partition) that were already cleared."""


class MissingColumnError(_LookupByName):
    """A read of a column the partition does not hold, or that the rows do not have yet.

    A KeyError, so a LookupError as RowsClearedError is: code that caught LookupError still
    catches it. On purpose not a BadPutError nor a RowsClearedError (the classes these reads
    raised before): nothing was put wrong and nothing was cleared, and keeping those as bases
    would keep ``except RowsClearedError`` treating a typo'd column name as lost rows."""


class CapacityError(TransferQueueError):
    """A storage unit stayed full for longer than the put's timeout, or a put can never fit."""


class TransferQueueTimeout(TransferQueueError, RpcTimeout):
    """A wait (for rows, or for a reply) ran past its timeout. The TransferQueue's clients
    raise it for a reply that does not come (an RpcTimeout, so RPC-level code catches it too)."""


register_error_types(
    TransferQueueError, UnknownPartitionError, UnknownTaskError, SchemaMismatchError,
    BadPutError, RowsClearedError, MissingColumnError, CapacityError, TransferQueueTimeout,
)

__all__ = [
    "TransferQueueError", "UnknownPartitionError", "UnknownTaskError", "SchemaMismatchError", "BadPutError",
    "RowsClearedError", "MissingColumnError", "CapacityError", "TransferQueueTimeout", "RemoteError",
]
