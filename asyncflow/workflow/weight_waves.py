"""Weight sync: each version published once by the policy, received by every instance in the
background, then swapped in by the instances in waves (never all at once); a member lost
meanwhile sends the version again over groups made without it."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from ..single_controller.protocol import Group
from ..weight_sync.publish import publish_and_swap
from .scheduling import Scheduling
from .stages import Stage

log = logging.getLogger(__name__)

_SYNC = Stage("weight_sync", role="actor", method="publish_weights", inputs=["-"], kind="map")


class InstanceLostInSync(RuntimeError):
    """A weight sync given up because one of its instances was lost (it is sent again)."""


class WeightWaves(Scheduling):
    async def _weight_sync(self) -> None:
        actor = self.groups[self.policy]
        while True:
            v = await self._sync_queue.get()
            taken = 1
            while not self._sync_queue.empty():  # an instance far behind takes the newest only
                v = self._sync_queue.get_nowait()
                taken += 1

            # The callbacks bind this iteration's version (publish_and_swap awaits them before the next).
            async def published(v: int = v) -> None:
                self.published_version = v
                await self.ledger.notify()

            async def swapped(members: list[int], v: int = v) -> None:
                for k in members:
                    self.instance_version[k] = v
                await self.ledger.notify()

            # Every instance starts receiving in the background (generating meanwhile), then the
            # actor ranks send; then the instances swap the new weights in, in waves of
            # cfg.swap_wave(n), so that at no moment are all of them paused (weight_sync.load=staged).
            # Each call is timed under step v: the step whose rollout the new weights serve (and
            # whose metrics log it).
            async def timed(g: Group, call: Awaitable[Any], v: int = v) -> Any:
                out = await self._timed(_SYNC, g.role, g.ranks, v, 0, call)
                first = out[0] if isinstance(out, list) and out else out
                if g is actor and isinstance(first, dict) and "bytes" in first:
                    # what one version moved (all tensors, in the rollout dtype): with LoRA, the adapters
                    self._keep_metrics(v, {"weight_sync/bytes": first["bytes"],
                                           "weight_sync/tensors": first.get("tensors", 0)})
                return out

            while True:
                members = [k for k in range(len(self.instances)) if k not in self.out_of_service]

                async def swapped_members(idx: list[int], members: list[int] = members) -> None:
                    await swapped([members[i] for i in idx])
                try:
                    if self.faults is not None and (self._sync_stale or members != self._sync_members):
                        # an instance was lost or has joined again: new groups of the ones serving (a
                        # member lost while they are made: made again without it, as in the sync below)
                        self._sync_stale = False
                        await self._unless_member_lost(
                            self.faults.rebuild_sync([self.instances[k] for k in members]), members)
                        self._sync_members = members
                    sync = publish_and_swap(actor, [self.instances[k] for k in members], v,
                                            wave=self.cfg.swap_wave(len(members)),
                                            timed=timed, on_published=published, on_swapped=swapped_members)
                    await (sync if self.faults is None else self._unless_member_lost(sync, members))
                    break
                except Exception:
                    # a member lost during the sync: make the groups without it and send v again
                    if self.faults is None or not await self.faults.lost_meanwhile(members, self.out_of_service):
                        raise
                    self._sync_stale = True
                    log.warning("weight sync of version %d: a rollout instance was lost meanwhile; sending it "
                                "again to the others", v)
            for _ in range(taken):
                self._sync_queue.task_done()

    async def _unless_member_lost(self, sync: Awaitable[None], members: list[int]) -> None:
        """Run a weight sync; if one of ``members`` is lost meanwhile, stop waiting for it and
        raise InstanceLostInSync: the others may wait on its groups until their timeout (a
        receive in progress cannot be ended), so the version goes again over new groups,
        into a new intake on each instance; the old waits end at weight_sync.timeout_s."""
        task = asyncio.ensure_future(sync)
        lost = asyncio.ensure_future(self.ledger.wait_for(lambda: any(k in self.out_of_service for k in members),
                                                          self.cfg.wait_timeout_s * 4, "a lost rollout instance"))
        try:
            await asyncio.wait([task, lost], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
            await asyncio.gather(lost, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise InstanceLostInSync(f"a rollout instance of {members} was lost during the weight sync")
        await task
