"""The built-in engine's running batch: the slots of the rows that are generating.

Row j of the batch lives in slot j of every per-slot structure: the KV cache
(``SlotKVCache``), the int64 columns (tokens sampled so far, budget, seed keys, the token to
feed next) and the output buffers (tokens and log-probs sampled so far). Rows join at the
end (their prefilled keys and values copied in) and leave by compaction; every token records
the policy version that sampled it. Which rows join or leave is the scheduler's
(``builtin.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncflow.engines.rollout.base import GenerationRequest, RequestId, RequestResult
from asyncflow.engines.rollout.model_runner import Place
from asyncflow.engines.rollout.sampling import _splitmix64
from asyncflow.engines.rollout.slot_cache import SlotKVCache

__all__ = ["Row", "RunningBatch"]

_MASK32 = 0xFFFFFFFF


@dataclass
class Row:
    """Python-side state of a running row (its tensors live in the batch's per-slot columns)."""
    req: GenerationRequest
    plen: int
    versions: list[tuple[int, int]]  # (first token index, policy version) segments


class RunningBatch:
    """The running rows in slot order, with their cache, columns and output buffers on ``device``."""

    def __init__(self, num_layers: int, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.max_rows = max_rows
        self.rows: list[Row] = []
        self.cache = SlotKVCache(num_layers)
        self.col: dict[str, torch.Tensor] = {}  # per-slot int64 columns: steps, budget, key_a, key_b, pending
        self._out_tok = torch.zeros((0, 0), dtype=torch.int64, device=device)
        self._out_lp = torch.zeros((0, 0), dtype=torch.float32, device=device)

    def __len__(self) -> int:
        return len(self.rows)

    def steps(self) -> list[int]:
        """Tokens sampled so far by each row."""
        return self.col["steps"].tolist() if self.rows else []

    def append(self, reqs: list[GenerationRequest], plens: list[int], places: list[Place], version: int) -> None:
        """Add prefilled rows at the end: their keys and values from ``places``, their first token
        to be sampled by ``version``."""
        n0, m = len(self.rows), len(reqs)
        cap = max(p + r.budget for p, r in zip(plens, reqs))
        gen_cap = max(r.budget for r in reqs)
        self.cache.reserve(n0 + m, cap, places[0][0], self.max_rows)
        self._reserve_out(n0 + m, gen_cap)
        self.cache.append(places, plens)
        mixed = [_splitmix64(int(r.seed)) for r in reqs]
        new = {"steps": torch.zeros(m, dtype=torch.int64),
               "budget": torch.tensor([r.budget for r in reqs], dtype=torch.int64),
               "key_a": torch.tensor([x & _MASK32 for x in mixed], dtype=torch.int64),
               "key_b": torch.tensor([x >> 32 for x in mixed], dtype=torch.int64),
               "pending": torch.zeros(m, dtype=torch.int64)}
        for k, v in new.items():
            v = v.to(self.device)
            self.col[k] = torch.cat([self.col[k][:n0], v]) if n0 else v
        self.rows += [Row(r, p, [(0, int(version))]) for r, p in zip(reqs, plens)]

    def _reserve_out(self, rows: int, gen_cap: int) -> None:
        r, c = self._out_tok.shape
        if rows <= r and gen_cap <= c:
            return
        nr = max(rows, r) if rows <= r else min(max(rows, r * 3 // 2), max(self.max_rows, rows))
        nc = max(gen_cap, c)
        tok = torch.zeros((nr, nc), dtype=torch.int64, device=self.device)
        lp = torch.zeros((nr, nc), dtype=torch.float32, device=self.device)
        n = len(self.rows)
        tok[:n, :c] = self._out_tok[:n]
        lp[:n, :c] = self._out_lp[:n]
        self._out_tok, self._out_lp = tok, lp

    def record(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Store every row's sampled token and log-prob; the token is fed by the next decode."""
        col = self.col
        slots = torch.arange(len(self.rows), device=self.device)
        self._out_tok[slots, col["steps"]] = tok
        self._out_lp[slots, col["steps"]] = lp
        col["steps"] = col["steps"] + 1
        col["pending"] = tok

    def retire(self, keep: torch.Tensor) -> list[Row]:
        """Drop the rows where ``keep`` is false (survivors move into their slots); the rows dropped."""
        order = self.cache.compact(keep)
        dropped = [row for row, k in zip(self.rows, keep.tolist()) if not k]
        self.rows = [self.rows[int(i)] for i in order]
        o = order.to(self.device)
        self.col = {k: v[o] for k, v in self.col.items()}
        m = o.numel()
        self._out_tok[:m] = self._out_tok[o]
        self._out_lp[:m] = self._out_lp[o]
        return dropped

    def result(self, slot: int, steps: int, reason: str) -> RequestResult:
        """The result of the row in ``slot`` after ``steps`` tokens (copied out of the buffers)."""
        row = self.rows[slot]
        versions = torch.empty(steps, dtype=torch.int64)
        bounds = [s for s, _ in row.versions[1:]] + [steps]
        for (start, v), end in zip(row.versions, bounds):
            versions[start:end] = v
        # copy=True: on the CPU .cpu() would return a view of buffers the next rows overwrite
        return RequestResult(row.req.request_id, self._out_tok[slot, :steps].to("cpu", copy=True),
                             self._out_lp[slot, :steps].to("cpu", copy=True), versions, reason)

    def new_tokens(self, since: Mapping[RequestId, int]) -> dict[RequestId, tuple[list[int], list[float]]]:
        """Each listed row's tokens (and log-probs) sampled after the first ``since[id]``."""
        if not since or not self.rows:
            return {}
        steps = self.col["steps"].tolist()
        out: dict[RequestId, tuple[list[int], list[float]]] = {}
        for j, row in enumerate(self.rows):
            seen = since.get(row.req.request_id)
            if seen is not None and steps[j] > seen:
                out[row.req.request_id] = (self._out_tok[j, seen:steps[j]].tolist(),
                                           self._out_lp[j, seen:steps[j]].tolist())
        return out

    def new_version(self, version: int) -> None:
        """The next token of every row is sampled by ``version``."""
        for row, s in zip(self.rows, self.steps()):
            row.versions.append((s, version))

    def fed_sequences(self) -> list[torch.Tensor]:
        """Each row's tokens that are in its cache: the prompt and the tokens fed so far (the last
        sampled one is fed by the next decode)."""
        seqs = []
        for j, (row, s) in enumerate(zip(self.rows, self.steps())):
            fed = self._out_tok[j, :s - 1].cpu()
            seqs.append(torch.cat([row.req.prompt_ids.to(torch.int64), fed]))
        return seqs

    def release(self) -> None:
        """Drop the cache and output buffers (kept between steps otherwise); the batch must be empty."""
        self.cache.release()
        self._out_tok = self._out_tok.new_zeros((0, 0))
        self._out_lp = self._out_lp.new_zeros((0, 0))
