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
