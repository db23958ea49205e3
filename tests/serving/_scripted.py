"""A request engine that answers from a script (prompt text -> reply text), for endpoint tests
that need a known reply (a tool call); the built-in engine's untrained model writes noise."""
from __future__ import annotations

from collections.abc import Callable

import torch

from asyncflow.engines.rollout.base import GenerationRequest, RequestEngine, RequestResult


class ScriptedEngine(RequestEngine):
    def __init__(self, tokenizer, reply: Callable[[str], str]) -> None:
        self.tok, self.reply, self.version = tokenizer, reply, 4
        self._queue: list[GenerationRequest] = []
        self._aborted: set = set()
        self.prompts: list[list[int]] = []

    def add_request(self, request: GenerationRequest) -> None:
        self._queue.append(request)

    def abort(self, request_id) -> bool:
        known = any(r.request_id == request_id for r in self._queue)
        if known:
            self._aborted.add(request_id)
        return known

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[RequestResult]:
        out, keep = [], []
        for r in self._queue:
            if r.request_id in self._aborted:
                out.append(RequestResult(r.request_id, torch.zeros(0, dtype=torch.long), torch.zeros(0),
                                         torch.zeros(0, dtype=torch.long), "abort"))
            elif r.min_version > self.version:
                keep.append(r)
            else:
                self.prompts.append(r.prompt_ids.tolist())
                text = self.reply(self.tok.decode(r.prompt_ids.tolist(), skip_special_tokens=False))
                ids = self.tok.encode(text, add_special_tokens=False)[:r.budget]
                stops = set(r.params.stop_token_ids) | {self.tok.eos_token_id}
                cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
                ids = ids[:cut]
                out.append(RequestResult(r.request_id, torch.tensor(ids, dtype=torch.long),
                                         torch.full((len(ids),), -0.25), torch.full((len(ids),), self.version),
                                         "stop" if cut < r.budget or ids[-1:] and ids[-1] in stops else "length"))
        self._queue = keep
        return out

    def load_weights(self, state_dict, version, mode="keep") -> None:
        self.version = version

    def stats(self) -> dict:
        return {"running": 0, "waiting": len(self._queue)}


class GatedEngine(RequestEngine):
    """Writes a fixed reply one token per step, and only as many tokens as the test has released
    (``release``): a test sees what a client receives while its request is still running."""

    def __init__(self, tokenizer, reply: str) -> None:
        import threading
        self.tok, self.version = tokenizer, 0
        self.reply = tokenizer.encode(reply, add_special_tokens=False)
        self.rows: dict = {}  # request id -> [request, tokens written]
        self._aborts: set = set()
        self._gate = threading.Semaphore(0)
        self.aborted = threading.Event()  # set when a running request is aborted

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    def running(self) -> list:
        return list(self.rows)

    def add_request(self, request: GenerationRequest) -> None:
        self.rows[request.request_id] = [request, []]

    def abort(self, request_id) -> bool:
        if request_id not in self.rows:
            return False
        self._aborts.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.rows)

    def _result(self, rid, reason: str) -> RequestResult:
        _, toks = self.rows.pop(rid)
        return RequestResult(rid, torch.tensor(toks, dtype=torch.long), torch.full((len(toks),), -0.5),
                             torch.full((len(toks),), self.version, dtype=torch.long), reason)

    def step(self) -> list[RequestResult]:
        out = [self._result(rid, "abort") for rid in list(self._aborts) if rid in self.rows]
        self._aborts.clear()
        if out:
            self.aborted.set()
        if not self.rows or not self._gate.acquire(timeout=0.01):
            return out
        for rid, (req, toks) in list(self.rows.items()):  # one more token for every row
            toks.append(self.reply[len(toks)])
            stops = set(req.params.stop_token_ids) | {self.tok.eos_token_id}
            if toks[-1] in stops:
                out.append(self._result(rid, "stop"))
            elif len(toks) >= min(req.budget, len(self.reply)):
                out.append(self._result(rid, "length"))
        return out

    def new_tokens(self, since) -> dict:
        return {rid: (self.rows[rid][1][n:], [-0.5] * (len(self.rows[rid][1]) - n))
                for rid, n in since.items() if rid in self.rows and len(self.rows[rid][1]) > n}

    def load_weights(self, state_dict, version, mode="keep") -> None:
        self.version = version

    def stats(self) -> dict:
        return {"running": len(self.rows), "waiting": 0}
