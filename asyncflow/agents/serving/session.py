"""One agent episode on the endpoint: its requests become generation requests on the rollout
service (through an ``EpisodeContext``: the row's staleness bound, the run's sampling params,
seeds per turn as the ``Conversation`` API draws them), and each answered one is recorded.

The prompt the engine sees: the rendered conversation, with the longest part that repeats
an earlier turn's text (its prompt and completion, special tokens included) reused as that
turn's exact token ids and only the rest encoded. So a model turn is never re-tokenized, and
each turn's prompt extends the previous one token for token (recorder.py's chain)."""
from __future__ import annotations

import asyncio
import weakref
from typing import Any

from ...engines.rollout.base import GenerationRequest, RequestResult, SamplingParams
from ...engines.rollout.service import TokenListener
from ...rpc.waits import wait_within
from ..episode import EpisodeContext, EpisodeLimits
from .bodies import accepted_sampling
from .chat_format import ChatFormat
from .limits import LimitExceeded, completion_budget
from .recorder import EpisodeRecord, Turn

__all__ = ["AgentSession"]

# tokenizer -> stop string -> its one token id (a stop string of several tokens is not kept: it raises)
_STOP_IDS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


class AgentSession:
    def __init__(self, row: dict[str, Any], *, service: Any, tokenizer: Any, chat_format: ChatFormat,
                 params: SamplingParams, limits: EpisodeLimits, min_version: int, request_id: Any,
                 run_sampling: tuple[float, float, int] | None = None) -> None:
        self.service = service
        # what a request may name for temperature, top_p, top_k (the episode samples with params)
        self.sampling = accepted_sampling(params.temperature, params.top_p, params.top_k, run_sampling)
        self.tokenizer = tokenizer
        self.format = chat_format
        self.limits = limits
        self.ctx = EpisodeContext(row, generate=self._submit, tokenizer=tokenizer, params=params, limits=limits,
                                  min_version=min_version, request_id=request_id)
        self.record = EpisodeRecord(prompt_ids=list(row["prompt_ids"]))
        self.request_id = request_id
        self.running: set[Any] = set()  # request ids on the service now
        self.admitted = 0  # requests past the limits (answered or running)
        self._texts = [(tokenizer.decode(self.record.prompt_ids, skip_special_tokens=False), self.record.prompt_ids)]

    # ---- prompts ---------------------------------------------------------------------------
    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a rendered prompt, reusing the ids of the longest recorded prefix."""
        best_text, best_ids = "", []
        for t, ids in self._texts:
            if len(t) > len(best_text) and text.startswith(t):
                best_text, best_ids = t, ids
        rest = text[len(best_text):]
        return list(best_ids) + (self.ctx.token_ids(rest) if rest else [])

    def budget(self, prompt_ids: list[int], asked: int | None) -> int:
        """Admit one more request (raises LimitExceeded); its completion budget."""
        try:
            n = completion_budget(self.limits, self.admitted, len(prompt_ids), len(self.record.prompt_ids), asked,
                                  self.ctx.params.max_new_tokens)
        except LimitExceeded as e:
            self.record.refused += 1
            if e.code == "episode_token_limit":  # the conversation as it ran out of tokens: its last text
                self.record.tail_ids = list(prompt_ids)
            raise
        self.admitted += 1
        return n

    # ---- generation ------------------------------------------------------------------------
    def stop_ids(self, stop: list[str]) -> list[int]:
        """Stop strings as token ids (ValueError for one that is not a single token). Every
        request names its stop strings again (the format's, the request's): each is encoded once
        per tokenizer."""
        known = _STOP_IDS.setdefault(self.tokenizer, {})
        out = []
        for s in stop:
            if s not in known:
                known[s] = self.ctx.stop_ids([s])[0]
            out.append(known[s])
        return out

    async def generate(self, prompt_ids: list[int], budget: int, stop_ids: list[int], prompt_text: str,
                       message_starts: list[int], *, on_tokens: TokenListener | None = None) -> Turn:
        """One turn; returns it (recorded unless it was aborted). ``on_tokens`` (called on the
        service's thread) gets its tokens as the engine samples them. Cancelled (the client went
        away), the request is aborted on the service and nothing is recorded."""
        r = await self._submit(self.ctx.next_request(prompt_ids, budget, stop_ids), on_tokens)
        if r.finish_reason == "error":
            raise RuntimeError(f"the engine refused the request: {r.error}")
        turn = Turn(list(prompt_ids), r.response_ids.tolist(), r.log_probs.float().tolist(), r.token_versions.tolist(),
                    r.finish_reason, prompt_text=prompt_text, message_starts=list(message_starts))
        if r.finish_reason != "abort":
            self.record.turns.append(turn)
            self._texts.append((self.tokenizer.decode(turn.ids, skip_special_tokens=False), turn.ids))
        return turn

    async def _submit(self, req: GenerationRequest, on_tokens: TokenListener | None = None) -> RequestResult:
        fut = asyncio.wrap_future(self.service.submit(req, on_tokens=on_tokens))
        self.running.add(req.request_id)
        try:
            # shielded: a cancelled handler must not cancel the service's future under it
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            asyncio.get_running_loop().run_in_executor(None, self.service.abort, req.request_id)
            raise
        finally:
            self.running.discard(req.request_id)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Abort what is still running (an agent that left requests behind)."""
        for rid in list(self.running):
            await wait_within(asyncio.to_thread(self.service.abort, rid), timeout_s)
