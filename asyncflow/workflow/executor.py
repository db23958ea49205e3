"""The streaming executor: one asyncio task per stage, each looping get_meta -> call -> put.

Rows of step ``t`` live in TransferQueue partition ``step<t>``. A feeder issues each
step's prompts; every stage takes the step's rows as they become ready (``stream`` and
``async``) or all at once (``sync``), calls its worker group, and the worker writes
the new columns back. Overlap follows from the data alone. The mode decides only:

- batch size: ``sync`` takes the whole step per call; in the others the rollout takes
  ``stage.batch_rows`` and every other stage at least that, with every row of the step ready
  by then (a stage that fell behind takes what piled up in one call, never past its step);
- weights: rollout of step ``t`` needs policy version ``>= t - k`` with ``k = 0`` for
  ``sync``/``stream`` (on-policy) and ``k = max_staleness`` for ``async``. Version ``v``
  is the policy after ``v`` updates; update ``t`` turns version ``t`` into ``t + 1``, so
  a row generated for step ``t`` is at most ``k`` versions old when it trains.

Rollout instances are separate worker groups, each pulling rows on its own. With
``rollout_service`` (disaggregated placement) an instance is a service: the executor
keeps its running batch full by submitting rows whenever slots free (whole groups, up to
its capacity, so a faster instance gets more rows), and the instance writes each row to
the TransferQueue as soon as it finishes. Otherwise each call generates a batch of rows in
the rank's call queue (colocated roles take turns on their ranks).

Weights: each version is published once, received by every instance in the background,
then swapped in by the instances in waves (never all at once), so generation never stops everywhere.

A lost rollout instance (with ``faults``, the run's InstanceFaults: its process died or hung)
is taken out of service: the rows it held and had not written are handed out again to the
others (reissue.py), the weight-sync groups are made again without it, and once its new
process has joined it is back in the groups and takes rows again from the first version
it swaps in.
"""
from __future__ import annotations

import asyncio

from .executor_config import ExecutorConfig, partition_name
from .executor_state import ExecutorState, StageState
from .feeding import Feeding
from .rollout_loops import RolloutLoops
from .scheduling import WOKEN
from .stage_dispatch import StageDispatch
from .stages import DRIVER
from .step_report import StepObserver, StepReport
from .training_loop import TrainingLoop
from .weight_waves import InstanceLostInSync, WeightWaves

__all__ = ["WOKEN", "Executor", "ExecutorConfig", "ExecutorState", "InstanceLostInSync", "StageState",
           "StepObserver", "StepReport", "partition_name"]


class Executor(Feeding, RolloutLoops, StageDispatch, TrainingLoop, WeightWaves):
    """Runs a recipe's stages over steps ``0..`` until ``stop()`` or ``max_steps``. Its parts:
    the feeder (feeding.py), the rollout instances' loops (rollout_loops.py), the other stages'
    loops (stage_dispatch.py), the update and the step reports (training_loop.py), the weight
    sync (weight_waves.py), over the shared state (executor_state.py), the accounts
    (accounting.py) and which rows each stage takes next (scheduling.py)."""

    def stop(self) -> None:
        """Issue no new steps; the steps already issued run to the end."""
        self._stop = True

    async def run(self, max_steps: int) -> None:
        self.max_steps = max_steps
        tasks = [asyncio.create_task(self._feeder(), name="feeder"),
                 asyncio.create_task(self._watch_closers(), name="closers"),
                 asyncio.create_task(self._weight_sync(), name="weight-sync"),
                 asyncio.create_task(self._reporter(), name="reporter")]
        for i, s in enumerate(self.stages):
            if s.kind == "rollout":
                tasks += [asyncio.create_task(self._instance_loop(s, k), name=f"{s.name}[{k}]")
                          for k in range(len(self.instances))]
            elif s.kind == "update":
                tasks.append(asyncio.create_task(self._update_loop(s), name=s.name))
            elif s.kind == "filter":
                tasks.append(asyncio.create_task(self._filter_loop(s), name=s.name))
            elif s.role == DRIVER:
                tasks.append(asyncio.create_task(self._driver_loop(s, i), name=s.name))
            else:
                tasks.append(asyncio.create_task(self._map_loop(s, i), name=s.name))
        update_task = tasks[-1] if self.stages[-1].kind == "update" else None
        try:
            # The update stage ends the run; any task that fails ends it too, with that error.
            pending = set(tasks)
            while update_task is not None and not update_task.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if (err := t.exception()) is not None:
                        raise err
            if update_task is not None:
                update_task.result()
            # Deliver the versions already published: a send that nobody receives would block the actor.
            sync = next(t for t in tasks if t.get_name() == "weight-sync")
            joined = asyncio.ensure_future(self._sync_queue.join())
            await asyncio.wait([joined, sync], timeout=self.cfg.wait_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if sync.done() and (err := sync.exception()) is not None:
                raise err
            if not joined.done():
                joined.cancel()
                raise TimeoutError(f"workflow: weight sync did not deliver the last versions within "
                                   f"{self.cfg.wait_timeout_s:.0f} s")
        finally:
            for t in [*tasks, *self._closers]:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
