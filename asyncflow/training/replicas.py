"""A stateless role beside replaceable rollout instances: one worker per instance rank, the
calls spread over the ranks in service, and a lost rank's share computed again elsewhere.

With ``fault.rollout_restarts`` an instance's rank may die at any time, and only groups of
that rank alone survive it (``Driver.tolerate_loss``). A role the recipe places on the
rollout side over several ranks (``placement.reward_with=rollout``) is therefore made as one
group per rollout rank, and this class stands in for the role's group:

- a DP_COMPUTE call (the reward stage's ``compute``) splits its rows over the members whose
  rank is in service. A member whose rank is lost during the call fails with
  WorkerDiedError; once its process is confirmed gone (``settle``: it can write nothing
  more), the rows of its share that already have the stage's output stay as they are and
  the others are computed again on the members in service. Columns are written once per
  row, so no row is scored twice, and none is left unscored. This holds because the
  role's calls are pure functions of their rows (a rule or a frozen reward model): the
  rows' second computation is the one the first would have written;
- a ONE_TO_ALL call (statistics) goes to every member in service, their replies in one list
  (a lost member's counts since its last start are gone with its process);
- any other call goes to the first member in service.

While no member is in service (every rollout rank lost at once), a call waits for one to be
back, at most ``wait_s``. A member's rank comes back when the driver builds the rank's
groups on its new process (``Driver.replace_rank``), this role's member among them.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..single_controller.dispatch import Dispatch
from ..single_controller.errors import WorkerDiedError
from ..transfer_queue.meta import BatchMeta
from ..workflow.stages import StageIO

_READ_ROWS = 4096  # rows per TransferQueue request when reading which rows have an output


class ReplicatedRole:
    """Role ``role``'s per-rank groups ``members`` (one rank each), called as one group."""

    def __init__(self, driver: Any, role: str, members: list[Any], wait_s: float):
        if not members or any(len(m.ranks) != 1 for m in members):
            raise ValueError(f"role {role!r}: a replicated role needs one group per rank, got "
                             f"{[m.ranks for m in members]}")
        self.driver, self.members, self.wait_s = driver, members, wait_s
        self._role = role
        self.cls = members[0].cls
        self.methods = members[0].methods
        self.tq: Any = None  # the TransferQueue client: which rows of a lost share have their output
        self.settle: Callable[[int], Awaitable[None]] | None = None  # a lost rank's process is gone
        self.recomputed_rows = 0  # rows computed again after their member was lost
        self._written: dict[tuple[str, str], set[int]] = {}  # (partition, column) -> rows seen written
        for name in self.methods:
            setattr(self, name, functools.partial(self.call, name))

    def __getattr__(self, name: str) -> Any:
        # only names that are not set: the worker's methods are bound in __init__
        raise AttributeError(f"role {self.__dict__.get('_role')!r}: its worker has no method {name!r}")

    @property
    def role(self) -> str:
        return self._role

    @property
    def ranks(self) -> list[int]:
        return sorted(m.ranks[0] for m in self.members)

    def attach(self, tq: Any, settle: Callable[[int], Awaitable[None]]) -> None:
        """What recomputing a lost share needs: the TransferQueue client, and how to wait until
        a lost rank's process is gone."""
        self.tq, self.settle = tq, settle

    def serving(self) -> list[Any]:
        """The members whose rank is in service (not declared dead), in rank order."""
        return [m for m in self.members if not self.driver.ranks[m.ranks[0]].dead.done()]

    async def _serving(self, what: str) -> list[Any]:
        deadline = time.monotonic() + self.wait_s
        while not (live := self.serving()):
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"{self._role}.{what}: none of ranks {self.ranks} came back into service "
                                      f"within {self.wait_s:.0f}s")
            await asyncio.sleep(0.1)
        return live

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        mode = self.methods[method].mode
        if mode == Dispatch.DP_COMPUTE:
            return await self._spread(method, args, kwargs)
        if mode == Dispatch.ONE_TO_ALL:
            replies = await asyncio.gather(*(m.call(method, *args, **kwargs) for m in await self._serving(method)),
                                           return_exceptions=True)
            if not all(isinstance(r, WorkerDiedError) for r in replies):  # a lost member's reply is left out
                bad = [r for r in replies if isinstance(r, BaseException) and not isinstance(r, WorkerDiedError)]
                if bad:
                    raise bad[0]
                return [x for r in replies if not isinstance(r, BaseException) for x in r]
            return await self.call(method, *args, **kwargs)  # every member was lost meanwhile: wait for one
        while True:
            member = (await self._serving(method))[0]
            try:
                return await member.call(method, *args, **kwargs)
            except WorkerDiedError:
                if not self._lost(member):
                    raise

    def _lost(self, member: Any) -> bool:
        """Whether ``member``'s rank is declared dead (a tolerated loss), not some other failure."""
        return bool(self.driver.ranks[member.ranks[0]].dead.done())

    async def _spread(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meta: BatchMeta = args[0]
        rest = args[1:]
        outputs = StageIO.of(rest[0] if rest else kwargs.get("io")).outputs
        if not len(meta):
            return await (await self._serving(method))[0].call(method, *args, **kwargs)
        done: list[BatchMeta] = []
        todo = meta
        while len(todo):
            live = await self._serving(method)
            shares = [(m, part) for m, part in zip(live, todo.chunk(len(live))) if len(part)]
            replies = await asyncio.gather(*(m.call(method, part, *rest, **kwargs) for m, part in shares),
                                           return_exceptions=True)
            again: list[BatchMeta] = []
            for (m, part), r in zip(shares, replies):
                if not isinstance(r, BaseException):
                    done.append(r)
                    continue
                if not (isinstance(r, WorkerDiedError) and self._lost(m)):
                    raise r
                left, kept = await self._unwritten(m, part, outputs)
                if len(kept):
                    done.append(kept)
                if len(left):
                    self.recomputed_rows += len(left)
                    again.append(left)
            todo = BatchMeta.concat(again) if again else meta.select([])
        return BatchMeta.concat(done)

    async def _unwritten(self, member: Any, part: BatchMeta, outputs: list[str]) -> tuple[BatchMeta, BatchMeta]:
        """The lost ``member``'s share split into (rows without the outputs, rows with them),
        once its process is gone."""
        if self.settle is None or self.tq is None:
            raise RuntimeError(f"{self._role}: a member was lost before attach() gave this role a TransferQueue "
                               f"client and a way to wait for the lost process")
        await self.settle(member.ranks[0])
        if not outputs:
            return part, part.select([])
        written = await self._rows_with(part.partition, outputs[0])
        left = [i for i, r in enumerate(part.rows) if r not in written]
        kept = [i for i, r in enumerate(part.rows) if r in written]
        return part.select(left), part.select(kept)

    async def _rows_with(self, partition: str, column: str) -> set[int]:
        """Rows of ``partition`` that have ``column`` (the lost call's put is one write: a row has
        all of the call's outputs or none), read through a task of its own so that the stages'
        consumption is untouched."""
        seen = self._written.setdefault((partition, column), set())
        while True:
            meta = await self.tq.get_meta([column], _READ_ROWS, f"{self._role}.recompute", partition,
                                          allow_partial=True, timeout=0.0)
            seen.update(meta.rows)
            if len(meta) < _READ_ROWS:
                return seen

    def __repr__(self) -> str:
        return f"ReplicatedRole({self.cls.__name__}, role={self._role!r}, ranks={self.ranks})"
