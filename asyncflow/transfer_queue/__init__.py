"""TransferQueue: the streaming, columnar store that moves every sample between RL stages.

A controller keeps metadata (rows, produced columns, consumption per task); storage
units keep bytes; clients put and get columns, variable-length ones without padding.
docs/architecture.md, section "TransferQueue", describes it as built.
"""
from .client import AsyncTransferQueueClient, TransferQueueClient
from .columns import FieldSchema, FixedColumn, JaggedColumn, ObjectColumn
from .errors import (
    BadPutError,
    CapacityError,
    MissingColumnError,
    RemoteError,
    RowsClearedError,
    SchemaMismatchError,
    TransferQueueError,
    TransferQueueTimeout,
    UnknownPartitionError,
    UnknownTaskError,
)
from .meta import BatchMeta
from .new_partition import NewPartition
from .protocol import AsyncTransferQueue, TransferQueue
from .samplers import register_sampler
from .service import TransferQueueConfig, TransferQueueService, serve_storage_unit

__all__ = [
    "AsyncTransferQueue", "TransferQueue", "AsyncTransferQueueClient", "TransferQueueClient",
    "TransferQueueService", "TransferQueueConfig", "serve_storage_unit", "BatchMeta", "NewPartition", "FieldSchema",
    "FixedColumn", "JaggedColumn", "ObjectColumn",
    "register_sampler", "TransferQueueError", "UnknownPartitionError", "UnknownTaskError",
    "SchemaMismatchError", "BadPutError", "RowsClearedError", "MissingColumnError", "CapacityError",
    "TransferQueueTimeout", "RemoteError",
]
