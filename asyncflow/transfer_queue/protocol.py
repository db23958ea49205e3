"""What the rest of AsyncFlow needs of a TransferQueue client, as two Protocols: the driver's
(``AsyncTransferQueue``, awaited) and a worker's (``TransferQueue``, blocking). The clients in
``client.py`` are the implementations; a stand-in (a simulation's or a test's) only has to
match these methods to be passed where a client is expected."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .columns import Column
from .meta import BatchMeta
from .new_partition import NewPartition
from .samplers import SamplerSpec

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .client import AsyncTransferQueueClient, TransferQueueClient

__all__ = ["AsyncTransferQueue", "TransferQueue"]


class AsyncTransferQueue(Protocol):
    """The driver's client (event-loop code): partitions per step, puts of new rows and of
    columns to existing rows, consumption by task (get_meta / get_batch_columns), reads."""

    async def create_partition(self, partition: str, tasks: Sequence[str] = (), *,
                               close_at: int | None = None) -> None: ...

    async def close_partition(self, partition: str) -> None: ...

    async def clear(self, partition: str) -> int: ...

    async def clear_then_stats(self, partition: str) -> tuple[int, list[dict[str, Any]]]: ...

    async def clear_rows(self, meta: BatchMeta) -> int: ...

    async def unit_stats(self) -> list[dict[str, Any]]: ...

    async def put(self, data: Any, partition: str, meta: BatchMeta | None = None, *,
                  groups: Sequence[int] | None = None, timeout: float | None = None,
                  create: NewPartition | None = None) -> BatchMeta: ...

    async def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                       sampler: SamplerSpec = "sequential", *, allow_partial: bool = False,
                       timeout: float | None = None, dp_group: str | None = None, dp_rank: int = 0,
                       dp_size: int = 1, min_rows: int = 0) -> BatchMeta: ...

    async def get_batch_columns(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                                sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                                allow_partial: bool = False, timeout: float | None = None,
                                dp_group: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                                min_rows: int = 0) -> tuple[BatchMeta, dict[str, Column] | None]: ...

    async def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]: ...

    async def close(self) -> None: ...


class TransferQueue(Protocol):
    """A worker's client (blocking, shared by its threads): reads of the rows it is handed,
    consumption by task for workers that pull their own batches, puts of the columns it adds."""

    def put(self, data: Any, partition: str, meta: BatchMeta | None = None, *,
            groups: Sequence[int] | None = None, timeout: float | None = None,
            create: NewPartition | None = None) -> BatchMeta: ...

    def get_meta(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                 sampler: SamplerSpec = "sequential", *, allow_partial: bool = False, timeout: float | None = None,
                 dp_group: str | None = None, dp_rank: int = 0, dp_size: int = 1) -> BatchMeta: ...

    def get_batch(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                  sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                  allow_partial: bool = False, timeout: float | None = None, dp_group: str | None = None,
                  dp_rank: int = 0, dp_size: int = 1) -> tuple[BatchMeta, TensorDict | None]: ...

    def get_batch_columns(self, columns: Sequence[str], batch_size: int, task: str, partition: str,
                          sampler: SamplerSpec = "sequential", *, data_columns: Sequence[str] | None = None,
                          allow_partial: bool = False, timeout: float | None = None, dp_group: str | None = None,
                          dp_rank: int = 0, dp_size: int = 1) -> tuple[BatchMeta, dict[str, Column] | None]: ...

    def get_columns(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> dict[str, Column]: ...

    def get_data(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> TensorDict: ...

    def close(self) -> None: ...


if TYPE_CHECKING:
    def _clients_conform(a: AsyncTransferQueueClient, b: TransferQueueClient) -> tuple[AsyncTransferQueue,
                                                                                         TransferQueue]:
        """mypy checks here that the clients implement the Protocols (never called)."""
        return a, b
