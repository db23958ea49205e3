"""The centralized baseline (verl's DataProto): every stage's data passes through the driver.

A ``DriverDataGroup`` stands in for a worker group in front of the executor: for each call
that names rows (a BatchMeta), the driver reads the rows' columns itself, sends them in the
call's arguments (split per data-parallel rank, as DataProto's dispatch does), receives the
new columns in the reply and writes them back. The executor, the ledger and the
TransferQueue's bookkeeping stay as they are, with the bytes in a storage unit inside the
driver's process: the driver's memory, as DataProto's is. Only the path of the bytes
differs from the TransferQueue runs; the simulated costs are the same.

What the driver carries: each call's input columns (``carried=None``), or, as a DataProto
trainer does (the whole batch goes to every worker call and the replies are merged into
it), every column the rows surely have by then (``carried``: the source's columns and
those of every stage the call's stage depends on; ``columns_before``). Padding to dense tensors is not
simulated: the columns stay jagged.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .. import column_names as col
from ..transfer_queue.meta import BatchMeta
from ..workflow.update_request import UpdateRequest
from .workers import lengths, pack, unpack


def columns_before(stages: Sequence[Any], source: Sequence[str]) -> dict[tuple[str, ...], list[str]]:
    """The columns a row surely has when each stage runs: the source's and the outputs of every
    stage it depends on, directly or not (the executor runs a stage when its inputs are ready,
    so a stage it does not depend on may not have run yet). Keyed by the stage's outputs
    (distinct for every stage of a recipe)."""
    producer = {c: st for st in stages for c in st.outputs}
    out: dict[tuple[str, ...], list[str]] = {}
    for st in stages:
        have, todo, seen = list(source), list(st.inputs), set()
        while todo:
            column = todo.pop()
            up = producer.get(column)
            if up is None or id(up) in seen:
                continue
            seen.add(id(up))
            have += [c for c in up.outputs if c not in have]
            todo += list(up.inputs)
        out[tuple(st.outputs)] = have
    return out


class DriverDataGroup:
    def __init__(self, group: Any, tq: Any, carried: dict[tuple[str, ...], list[str]] | None = None):
        self.group = group
        self.tq = tq
        self.carried = carried

    def _names(self, io: dict) -> list[str]:
        """The columns the driver sends for a call: its inputs, or every column the rows have."""
        if self.carried is None:
            return list(io["inputs"])
        key = tuple(io["outputs"])
        if key not in self.carried:
            raise KeyError(f"no stage writes {list(key)}: cannot tell which columns its rows have")
        return self.carried[key]

    def __getattr__(self, name: str) -> Any:  # weight sync, stats, probes: unchanged
        return getattr(self.group, name)

    async def _columns(self, metas: list[BatchMeta], names: list[str]) -> list[dict]:
        """The rows' columns, read by the driver (Column objects; {} for an empty share)."""
        async def one(m: BatchMeta) -> dict:
            return await self.tq.get_columns(m, names) if len(m) else {}
        return list(await asyncio.gather(*(one(m) for m in metas)))

    @staticmethod
    def _tokens(cols: dict, names: tuple[str, ...] = (col.PROMPT_IDS, col.RESPONSE_IDS)) -> int:
        return sum(sum(lengths(c)) for k, c in cols.items() if k in names)

    async def _write(self, metas: list[BatchMeta], outs: list[dict]) -> None:
        await asyncio.gather(*(self.tq.put(unpack(o), m.partition, m) for m, o in zip(metas, outs) if len(m) and o))

    # ---- the rollout (one instance: one rank) ---------------------------------------------------
    async def generate(self, meta: BatchMeta, min_version: int, io: dict) -> BatchMeta:
        cols = (await self._columns([meta], self._names(io)))[0]
        out = await self.group.generate_data(pack(cols), min_version, io)
        await self._write([meta], [out])
        return meta

    # ---- map stages over a data-parallel group ----------------------------------------------------
    def _split(self, meta: BatchMeta) -> list[BatchMeta]:
        parts = meta.chunk(self.group.layout.dp_size)
        return [parts[self.group.layout.shard_of(i)] for i in range(self.group.layout.size)]

    async def compute(self, meta: BatchMeta, io: dict) -> BatchMeta:
        parts = self._split(meta)
        n = len(parts)
        cols = await self._columns(parts, self._names(io))
        outs = await self.group.compute_data([pack(c) for c in cols], [io] * n)
        await self._write(parts, outs)
        return meta

    async def compute_log_probs(self, meta: BatchMeta, io: dict) -> None:
        parts = self._split(meta)
        names = list(io["inputs"][:2])
        cols = await self._columns(parts, self._names(io))
        largest = float(max((self._tokens(c, tuple(names)) for c in cols), default=0))
        n = len(parts)
        outs = await self.group.compute_log_probs_data([pack(c) for c in cols], [largest] * n, [io] * n)
        await self._write(parts, outs)

    # ---- the update: the driver samples the step's rows and sends each rank its share ---------------
    async def update(self, step: int, request: dict, io: dict) -> list:
        layout = self.group.layout
        req = UpdateRequest.from_wire(request)
        meta = await self.tq.get_meta(list(io["inputs"]), req.rows, req.task, req.partition,
                                      {"name": "token_balanced", "dp_size": layout.dp_size},
                                      timeout=req.timeout_s)
        parts = self._split(meta)
        cols = await self._columns(parts, self._names(io))
        largest = float(max((self._tokens(c) for c in cols), default=0))
        n = len(parts)
        return await self.group.update_data([step] * n, [pack(c) for c in cols], [largest] * n, [io] * n)
