"""The Worker base class: plain Python methods, marked for the driver with ``@register``.

A subclass's ``__init__`` takes only its own keyword arguments; the runtime sets the
context below (rank, group layout, process groups, TransferQueue client) *before*
calling it, so ``__init__`` can already build models on ``self.device`` and use
``self.process_group``. Colocated roles share a process; before a role runs a method
after another role did, the runtime calls ``offload()`` on the previous one and
``onload()`` on the next (e.g. move weights between host and device).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..platform import Platform
from .layout import GroupLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..transfer_queue.protocol import TransferQueue


@dataclass
class WorkerContext:
    rank: int  # global rank
    world_size: int
    local_rank: int
    layout: GroupLayout
    platform: Platform
    process_group: ProcessGroup | None  # the whole worker group (None when it is a single rank)
    shard_group: ProcessGroup | None  # the ranks that share a data shard (None when alone)
    dp_group: ProcessGroup | None  # the ranks at this position of every shard (None when alone)
    tq_factory: Callable[[], TransferQueue]  # returns this process's TransferQueueClient
    # The group of these ranks made by Driver.make_group (every rank made it, in the same order)
    group_of: Callable[[list[int]], ProcessGroup | None] = lambda ranks: None


class Worker:
    _ctx: WorkerContext
    # Colocated roles take turns on a rank. A role that holds no device memory (e.g. a rule-based
    # reward) sets this False: it then runs beside whichever role is loaded, and no state moves.
    needs_device: bool = True

    # ---- identity ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def role(self) -> str:
        return self._ctx.layout.role

    @property
    def layout(self) -> GroupLayout:
        return self._ctx.layout

    @property
    def group_rank(self) -> int:
        return self._ctx.layout.ranks.index(self._ctx.rank)

    @property
    def group_size(self) -> int:
        return self._ctx.layout.size

    @property
    def dp_rank(self) -> int:
        return self._ctx.layout.shard_of(self.group_rank)

    @property
    def dp_size(self) -> int:
        return self._ctx.layout.dp_size

    @property
    def shard_ranks(self) -> list[int]:
        return self._ctx.layout.shard_ranks(self.dp_rank)

    @property
    def is_shard_leader(self) -> bool:
        return self._ctx.layout.is_leader(self.group_rank)

    # ---- devices and collectives ---------------------------------------------------------
    @property
    def platform(self) -> Platform:
        return self._ctx.platform

    @property
    def device(self) -> torch.device:
        return self._ctx.platform.device_for_local_rank(self._ctx.local_rank)

    @property
    def collective_device(self) -> torch.device | None:
        """Where object collectives stage their bytes: None (host) on gloo."""
        return self.device if self._ctx.platform.is_accelerator else None

    @property
    def process_group(self) -> ProcessGroup | None:
        return self._ctx.process_group

    def group_of(self, ranks: list[int]) -> ProcessGroup | None:
        """The process group of ``ranks`` that the driver made with ``make_group`` (this rank a member)."""
        return self._ctx.group_of(ranks)

    @property
    def shard_group(self) -> ProcessGroup | None:
        return self._ctx.shard_group

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._ctx.dp_group

    @property
    def tq(self) -> TransferQueue:
        """This process's TransferQueueClient (blocking); the driver must have set the address."""
        return self._ctx.tq_factory()

    # ---- colocation hooks ----------------------------------------------------------------
    def onload(self) -> None:
        """Called before this role runs a method after another role (one that
        ``needs_device``) ran on this rank."""

    def offload(self) -> None:
        """Called when another role that ``needs_device`` is about to run on this rank."""

    def teardown(self) -> None:
        """Called once when the rank shuts down, before its sockets close (a failure is logged)."""
