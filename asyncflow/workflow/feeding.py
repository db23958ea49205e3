"""The feeder: each step's prompts into the TransferQueue once the policy allows the step,
refills of dropped groups (dynamic sampling), and the step closed once no more will come."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .. import column_names as col
from ..transfer_queue.new_partition import NewPartition
from .executor_config import partition_name
from .scheduling import Scheduling
from .staleness import min_version

log = logging.getLogger(__name__)


class Feeding(Scheduling):
    async def _feeder(self) -> None:
        cfg = self.cfg
        t = self.first_step
        while True:
            if self._stop or t - self.first_step >= self.max_steps:
                self.last_step = t - 1
                await self.ledger.notify()
                return
            # Issue step t once its rollout may start: version >= t - lag.
            def issuable(t: int = t) -> bool:
                return self.actor_version >= min_version(t, cfg.lag) or self._stop

            await self.ledger.wait_for(issuable, cfg.wait_timeout_s * 4,
                                       f"policy version {min_version(t, cfg.lag)} to issue step {t}")
            if self._stop:
                continue
            # Without refills the step's row count is known now: the partition closes itself once
            # it holds them (no close_partition request a step). It is created by the put of the
            # step's prompts (no create_partition request a step).
            close_at = None if cfg.dynamic_sampling else cfg.prompts_per_step * cfg.group_size
            self.step_started[t] = time.monotonic()
            await self._issue(t, cfg.prompts_per_step, NewPartition(close_at=close_at))
            # Refilling and closing step t runs on its own, so step t+1 may start meanwhile.
            closing = asyncio.create_task(self._close_step(t), name=f"close-step{t}")
            self._closers.add(closing)
            closing.add_done_callback(self._closer_done)
            t += 1

    def _closer_done(self, task: asyncio.Task[Any]) -> None:
        self._closers.discard(task)
        if not task.cancelled() and (err := task.exception()) is not None:
            self._closer_errors.append(err)
            self._closer_failed.set()

    async def _watch_closers(self) -> None:
        await self._closer_failed.wait()
        raise self._closer_errors[0]

    async def _close_step(self, t: int) -> None:
        if self.cfg.dynamic_sampling:
            await self._refill(t)
        self.ledger.step(t).closed = True
        if self.cfg.dynamic_sampling:  # else it closed itself with its last row (close_at)
            await self.tq.close_partition(partition_name(t))
        await self.ledger.notify()

    async def _issue(self, t: int, n_prompts: int, create: NewPartition | None = None) -> None:
        """Step ``t``'s next ``n_prompts`` prompts into its partition (``create``: the step's first
        put, which creates the partition)."""
        cols = await self.source(t, n_prompts)
        n_rows = n_prompts * self.cfg.group_size
        groups = cols.pop("__groups__", None)
        got = len(cols[col.PROMPT_IDS])
        if got != n_rows:  # the partition was created for exactly the rows asked for
            raise ValueError(f"step {t}: the prompt source gave {got} rows for {n_prompts} prompts x "
                             f"{self.cfg.group_size}; a source returns group_size rows for every prompt asked")
        s = self.ledger.step(t)
        if groups is not None:  # before any await: a checkpoint may look at the ledger meanwhile
            s.uids.extend(dict.fromkeys(groups))
        await self.tq.put(cols, partition_name(t), groups=groups, create=create)
        s.issued += n_rows
        s.prompts += n_prompts
        self.prompts_issued += n_prompts
        await self.ledger.notify()

    async def _refill(self, t: int) -> None:
        """Dynamic sampling: replace dropped groups with new prompts until the step is full."""
        cfg = self.cfg
        budget = int(cfg.prompts_per_step * cfg.max_refill_factor)
        s = self.ledger.step(t)
        while True:
            await self.ledger.wait_for(
                lambda: s.accepted_groups + s.rejected_groups >= s.prompts, cfg.wait_timeout_s,
                f"the filter's decision on every group of step {t}")
            missing = cfg.prompts_per_step - s.accepted_groups
            if missing <= 0 or s.prompts >= budget:
                if missing > 0 and cfg.max_refill_factor > 1:
                    log.warning("step %d: only %d of %d groups have reward variance after %d prompts; "
                                "training on those", t, s.accepted_groups, cfg.prompts_per_step, s.prompts)
                return
            await self._issue(t, min(missing, budget - s.prompts))
