"""Lost rollout instances: the restart policy, the new process, the weight-sync groups
made again around it, and the run's count of it all.

The driver reports an instance's rank lost (``Driver.tolerate_loss``: it stopped answering
heartbeats, dead or hung); the executor then gives its rows back (workflow/reissue.py) and
awaits ``back_in_service``: after the back-off, the launcher starts a new process on the rank
(``supervise.request_restart``), the driver attaches it and builds the instance's worker
on it again (``Driver.replace_rank``), and the executor adds it to the weight-sync groups of
the next version, from which it takes rows again. An instance lost more often than
``fault.max_restarts_per_instance``, or the run's instances more often than
``fault.max_restarts_per_run`` in all, stop the run with ``InstanceGaveUp``, which names the
instance and its last error (the run then ends as any failed run does: its last checkpoint
and the command that resumes from it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..single_controller.errors import WorkerDiedError
from ..single_controller.supervise import last_exit, mark_replaceable, request_restart, wait_restarted
from .replicas import ReplicatedRole
from .roles import init_weight_sync

log = logging.getLogger(__name__)


class InstanceGaveUp(RuntimeError):
    """A rollout instance was lost more often than the restart policy allows."""


@dataclass
class InstanceRecord:
    rank: int
    failures: int = 0
    restarts: int = 0
    last_error: str = ""
    lost_at: float | None = None  # monotonic time of the loss not yet repaired
    seconds_lost: float = 0.0  # out of service, from each loss to the new process's joining
    rows_reissued: int = 0
    pids: list[int] = field(default_factory=list)


class InstanceFaults:
    """One run's lost rollout instances (``cfg``: the run's ``fault`` section)."""

    def __init__(self, driver: Any, cfg: Any, policy: Any, instances: list[Any]):
        self.driver, self.cfg, self.policy, self.instances = driver, cfg, policy, instances
        self.records = [InstanceRecord(inst.ranks[0]) for inst in instances]
        self._by_rank = {inst.ranks[0]: k for k, inst in enumerate(instances)}
        self.restarts = 0
        self.executor: Any = None
        self.replicated: list[ReplicatedRole] = []  # roles beside the instances (placement.reward_with=rollout)
        self.on_back: Callable[[], None] | None = None  # e.g. ranks.json written again (the new pid)
        hb = driver.config
        # how long after a failed call the driver has declared its rank lost, at the latest
        self.detect_s = hb.heartbeat_misses * (hb.heartbeat_timeout_s + hb.heartbeat_interval_s) + 1.0

    def arm(self, executor: Any) -> None:
        """From now on a lost instance's rank does not stop the run: ``executor`` handles it."""
        self.executor = executor
        ranks = list(self._by_rank)
        self.driver.tolerate_loss(ranks, self._lost)
        for g in executor.groups.values():  # a role beside the instances: a lost rank's share is computed again
            if isinstance(g, ReplicatedRole):
                g.attach(executor.tq, self.settle_rank)
                self.replicated.append(g)
        if self.driver.store is None:
            log.warning("fault.rollout_restarts: no launcher store (started under torchrun?): a lost rollout "
                        "instance is taken out of service but cannot be restarted")
            return
        for r in ranks:
            mark_replaceable(self.driver.store, r)

    # ---- the loss ------------------------------------------------------------------------------
    def _lost(self, rank: int, err: WorkerDiedError, pid: int | None = None) -> None:
        k = self._by_rank[rank]
        rec = self.records[k]
        rec.failures += 1
        # the launcher says how the process ended (it sees the exit well within the heartbeats' bound)
        ended = last_exit(self.driver.store, rank) if self.driver.store is not None else ""
        rec.last_error = f"{ended}; {err}" if ended and f"(pid {pid})" in ended else str(err)
        if rec.lost_at is None:  # (a new process lost while it joins: the same time out of service)
            rec.lost_at = time.monotonic()
        pid = self._local_pid(rank, pid)
        if pid is not None:  # a hung process must not write rows once they are given back
            rec.pids.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.executor is not None:
            self.executor.instance_lost(k)

    def _local_pid(self, rank: int, pid: int | None) -> int | None:
        """``pid`` where the rank's processes run on this host (the driver's), else None."""
        info = getattr(self.driver.ranks[rank], "info", None) or {}
        if pid and info.get("host") == socket.gethostname() and pid != os.getpid():
            return int(pid)
        return None

    @staticmethod
    def is_loss(e: BaseException) -> bool:
        return isinstance(e, WorkerDiedError)

    async def confirm_dead(self, k: int) -> None:
        """Wait (bounded) until instance ``k``'s process is gone, where it runs on this host; a
        remote one is restarted, which kills it, before its rows could be written twice."""
        rec = self.records[k]
        deadline = time.monotonic() + 10.0
        for pid in rec.pids[-1:]:
            while _alive(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # writes it sent before it died reach the TransferQueue first

    async def settle_rank(self, rank: int) -> None:
        """``confirm_dead`` of the instance on ``rank`` (a replicated role's lost member)."""
        await self.confirm_dead(self._by_rank[rank])

    def reissued(self, k: int, rows: int) -> None:
        self.records[k].rows_reissued += rows

    async def lost_meanwhile(self, members: list[int], out_of_service: set[int]) -> bool:
        """After a failed weight sync: whether one of ``members`` is lost, waiting up to the
        heartbeats' bound for the driver to say so."""
        deadline = time.monotonic() + self.detect_s
        while True:
            if any(k in out_of_service for k in members):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)

    # ---- the restart ---------------------------------------------------------------------------
    def _check_budget(self, k: int) -> None:
        rec, c = self.records[k], self.cfg
        over = None
        if rec.restarts >= c.max_restarts_per_instance:
            over = f"it was restarted {rec.restarts} times already (fault.max_restarts_per_instance=" \
                   f"{c.max_restarts_per_instance})"
        elif self.restarts >= c.max_restarts_per_run:
            over = f"the run's instances were restarted {self.restarts} times already (fault.max_restarts_per_run=" \
                   f"{c.max_restarts_per_run})"
        elif self.driver.store is None:
            over = "no launcher can restart it (started under torchrun)"
        if over:
            raise InstanceGaveUp(f"rollout instance {k} ({self.instances[k].role}, rank {rec.rank}) was lost "
                                 f"{rec.failures} times and is not restarted again: {over}. Its last error: "
                                 f"{rec.last_error}")

    def backoff(self, restarts: int) -> float:
        """Seconds before the next restart of an instance restarted ``restarts`` times so far."""
        return min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2 ** restarts)

    async def back_in_service(self, k: int) -> None:
        """Restart lost instance ``k`` on its rank and attach it (new tries while its start
        fails, each counted against the budget); InstanceGaveUp once the budget is spent."""
        rec, c = self.records[k], self.cfg
        while True:
            self._check_budget(k)
            delay = self.backoff(rec.restarts)
            log.warning("rollout instance %d (rank %d) is lost (%s); restart %d in %.1f s", k, rec.rank,
                        rec.last_error.splitlines()[0] if rec.last_error else "?", rec.restarts + 1, delay)
            await asyncio.sleep(delay)
            rec.restarts += 1
            self.restarts += 1
            try:
                request_restart(self.driver.store, rec.rank, rec.restarts)
                address = await asyncio.to_thread(wait_restarted, self.driver.store, rec.rank, rec.restarts,
                                                  c.rejoin_timeout_s)
                await self.driver.replace_rank(rec.rank, address, c.rejoin_timeout_s)
            except Exception as e:  # noqa: BLE001 - its start failed: another try, within the budget
                if self.is_loss(e):  # the new process was lost: counted, and said how, when the driver saw it
                    rec.last_error = f"its restart {rec.restarts} failed: {rec.last_error}"
                else:
                    rec.failures += 1
                    rec.last_error = f"its restart {rec.restarts} failed: {type(e).__name__}: {e}"
                log.warning("rollout instance %d: %s", k, rec.last_error)
                continue
            if rec.lost_at is not None:
                rec.seconds_lost += time.monotonic() - rec.lost_at
                rec.lost_at = None
            if self.on_back is not None:
                self.on_back()
            log.warning("rollout instance %d (rank %d) is back (restart %d); it takes rows from the next version",
                        k, rec.rank, rec.restarts)
            return

    async def rebuild_sync(self, instances: list[Any]) -> None:
        """New weight-sync groups between the policy and ``instances`` (those in service)."""
        await init_weight_sync(self.policy, instances)

    # ---- the account ---------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        now = time.monotonic()
        recs = self.records
        return {"failures": sum(r.failures for r in recs), "restarts": self.restarts,
                "rows_reissued": sum(r.rows_reissued for r in recs),
                # rows a role beside a lost instance (its reward) had not written, computed again elsewhere
                "rows_recomputed": sum(g.recomputed_rows for g in self.replicated),
                "seconds_lost": sum(r.seconds_lost + (now - r.lost_at if r.lost_at is not None else 0.0)
                                    for r in recs)}

    def metrics(self) -> dict[str, float]:
        """Run totals so far, for each step's metrics."""
        return {f"faults/{k}": float(v) for k, v in self.totals().items()}

    def summary(self) -> dict[str, Any]:
        return {**self.totals(), "instances": [
            {"instance": k, "rank": r.rank, "failures": r.failures, "restarts": r.restarts,
             "rows_reissued": r.rows_reissued, "seconds_lost": r.seconds_lost, "last_error": r.last_error}
            for k, r in enumerate(self.records)]}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its launcher has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
