"""The map, driver and filter stages' loops: take the step's rows, call the worker group (which
reads its rows and writes the new columns) or run the driver function and write its columns."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import torch

from .executor_config import partition_name
from .scheduling import Scheduling
from .stages import DriverBatch, Stage


class StageDispatch(Scheduling):
    async def _map_loop(self, stage: Stage, index: int) -> None:
        group = self.groups[stage.role]
        # proximal log-probs (on_policy_weights): the weights that update t starts from
        allowed = (lambda t: self.actor_version >= t) if stage.on_policy_weights else (lambda t: True)
        while work := await self._next_work(stage, index, allowed):
            t, asked = work
            most, least = self._work_size(stage, asked)
            meta = await self.tq.get_meta(stage.inputs, most, stage.name, partition_name(t), stage.sampler,
                                          timeout=self.cfg.wait_timeout_s, min_rows=least)
            n = len(meta)
            self._took(stage, t, asked, n)
            out = await self._timed(stage, group.role, group.ranks, t, n,
                                    getattr(group, stage.method)(meta, stage.io.to_wire()))
            self._keep_metrics(t, out)
            await self._rows_done(stage, t, n)

    async def _rows_done(self, stage: Stage, t: int, n: int) -> None:
        """``n`` more rows of step ``t`` are back from ``stage`` (``_maps_done`` counts them)."""
        done = self.state[stage.name].done
        done[t] = done.get(t, 0) + n
        await self.ledger.notify()

    async def _driver_batch(self, stage: Stage, t: int, asked: int) -> tuple[Any, DriverBatch]:
        """The stage's next rows of step ``t`` (``asked`` booked) and their columns: one TransferQueue
        request (get_batch) where the service holds the rows, as a driver stage reads what it takes."""
        most, least = self._work_size(stage, asked)
        meta, cols = await self.tq.get_batch_columns(stage.inputs, most, stage.name, partition_name(t), stage.sampler,
                                                     timeout=self.cfg.wait_timeout_s, min_rows=least)
        self._took(stage, t, asked, len(meta))
        if cols is None:  # no rows: the columns of none
            cols = await self.tq.get_columns(meta, list(stage.inputs))
        return meta, DriverBatch(t, {c: _plain(col) for c, col in cols.items()},
                                 list(meta.groups) if meta.groups else list(range(len(meta))), dict(stage.options))

    async def _run_fn(self, stage: Stage, batch: DriverBatch) -> Any:
        """The stage's function, off the event loop (it may be heavy tensor math)."""
        if stage.fn is None:  # check_graph: a driver stage names its function
            raise ValueError(f"driver stage {stage.name!r} has no function")
        try:
            return await asyncio.to_thread(stage.fn, batch)
        except Exception as e:
            raise RuntimeError(f"driver stage {stage.name!r} ({_fn_name(stage.fn)}) raised at step {batch.step}: "
                               f"{type(e).__name__}: {e}") from e

    async def _driver_loop(self, stage: Stage, index: int) -> None:
        """A driver stage: its function computes new columns from the batch's columns."""
        while work := await self._next_work(stage, index, lambda t: True):
            t, n = work
            meta, batch = await self._driver_batch(stage, t, n)
            start = time.monotonic()
            out = _outputs(stage, await self._run_fn(stage, batch), len(meta))
            if out:
                await self.tq.put(out, partition_name(t), meta)
            timing = self.step_timing.setdefault(t, {})
            timing[stage.name] = timing.get(stage.name, 0.0) + time.monotonic() - start
            await self._rows_done(stage, t, len(meta))

    async def _filter_loop(self, stage: Stage) -> None:
        """Driver-side: the stage's function keeps or drops whole groups (dynamic sampling);
        dropped rows leave the step, kept rows get the stage's output column (the gate the
        later stages read), and the step is refilled with new prompts until it is full."""
        index = self.stages.index(stage)
        while work := await self._next_work(stage, index, lambda t: True):
            t, n = work
            meta, batch = await self._driver_batch(stage, t, n)
            keep_mask = await self._run_fn(stage, batch)
            keep_rows = _keep_mask(stage, keep_mask, batch)
            keep = {g for g, k in zip(batch.groups, keep_rows) if k}
            rows_keep = [i for i, k in enumerate(keep_rows) if k]
            rows_drop = [i for i, k in enumerate(keep_rows) if not k]
            s = self.ledger.step(t)
            if rows_drop:
                await self.tq.clear_rows(meta.select(rows_drop))
            s.accepted += len(rows_keep)
            if rows_keep and stage.outputs:
                await self.tq.put({stage.outputs[0]: torch.ones(len(rows_keep), dtype=torch.int8)},
                                  partition_name(t), meta.select(rows_keep))
            s.accepted_groups += len(keep)
            s.rejected_groups += len(set(batch.groups)) - len(keep)
            await self.ledger.notify()


def _plain(col: Any) -> Any:
    """A TransferQueue column as a driver function sees it: a tensor per fixed column, a list
    of 1-D tensors per jagged one, a list per object column."""
    if col.kind == "object":
        return list(col.items)
    if col.kind == "jagged":  # views of the values, cut in one call
        return list(col.values.split(col.lengths().tolist()))
    return col.data

def _fn_name(fn: Any) -> str:
    """The function's name and the file that defines it (the recipe's, usually)."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        return f"{name} in {inspect.getsourcefile(fn)}"
    except TypeError:  # a builtin or a callable object
        return name

def _outputs(stage: Stage, out: Any, n: int) -> dict[str, Any]:
    """A driver function's result as the stage's declared output columns."""
    if len(stage.outputs) == 1 and not isinstance(out, dict):
        out = {stage.outputs[0]: out}
    if not isinstance(out, dict):
        raise TypeError(f"driver stage {stage.name!r}: {_fn_name(stage.fn)} must return a dict of its output "
                        f"columns {stage.outputs}, got {type(out).__name__}")
    missing = [c for c in stage.outputs if c not in out]
    if missing:
        raise ValueError(f"driver stage {stage.name!r}: {_fn_name(stage.fn)} returned {sorted(out)}, "
                         f"without its declared outputs {missing}")
    for c in stage.outputs:
        if len(out[c]) != n:
            raise ValueError(f"driver stage {stage.name!r}: column {c!r} has {len(out[c])} rows for a batch of {n}")
    return {c: out[c] for c in stage.outputs}

def _keep_mask(stage: Stage, keep: Any, batch: DriverBatch) -> list[bool]:
    """A filter function's result as one bool per row, deciding whole groups."""
    flags = [bool(k) for k in (keep.tolist() if hasattr(keep, "tolist") else keep)]
    if len(flags) != len(batch):
        raise ValueError(f"filter stage {stage.name!r}: {_fn_name(stage.fn)} returned {len(flags)} flags for "
                         f"{len(batch)} rows (one bool per row: True keeps it)")
    decided: dict[int, bool] = {}
    for g, k in zip(batch.groups, flags):
        if decided.setdefault(g, k) != k:
            raise ValueError(f"filter stage {stage.name!r}: {_fn_name(stage.fn)} keeps part of group {g}; a "
                             "filter keeps or drops whole groups (the group sampler gives it whole groups)")
    return flags
