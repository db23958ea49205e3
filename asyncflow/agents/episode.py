"""Multi-turn episodes: the model writes, a tool or the environment answers, the model goes on.

A recipe's episode is one async function ``episode(row, ctx) -> Trajectory``. ``ctx.start()``
opens the conversation at the row's prompt; ``await conv.model(...)`` generates a model turn
on the rollout service (its tokens are trained: loss mask 1), ``await conv.tool(name, ...)``
calls a registered tool and appends its output, ``conv.env(text)`` appends any other text
(neither is trained: loss mask 0), and ``conv.finish(reward)`` returns the trajectory. Many
episodes run at once on an instance; their model turns share its running batch, and each
turn is admitted under the row's staleness bound, so one episode's turns may span versions
(each token records its own).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import column_names as col
from ..engines.rollout.base import GenerationRequest, RequestResult, SamplingParams
from .tools import call_tool

__all__ = ["Conversation", "EpisodeContext", "EpisodeLimits", "Trajectory"]

FINISH_REASONS = ("stop", "max_turns", "max_tokens", "tool_end", "abort", "time_limit", "error")


@dataclass
class EpisodeLimits:
    max_turns: int = 4  # model turns at most (an agent's requests)
    max_tokens: int = 64  # tokens after the prompt at most (model and tool text together)
    max_time_s: float = 300.0  # an agent episode's wall time (asyncflow.agents.serving: its key expires then)


@dataclass
class Trajectory:
    """One episode as a trained row: everything after the prompt, with which tokens the model
    wrote (``loss_mask`` 1) and which were tool or environment text (0)."""
    response_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int8 [T]
    log_probs: torch.Tensor  # float32 [T]: behaviour log-probs of model tokens, 0 elsewhere
    token_versions: torch.Tensor  # int64 [T]: the policy version of each model token (others: the turn before's)
    turn_starts: list[int]  # offset of each model turn in response_ids
    reward: float
    finish_reason: str
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def gen_version(self) -> int | None:
        """The version of the oldest model token (None when the model wrote nothing)."""
        mine = self.token_versions[self.loss_mask.bool()]
        return int(mine.min()) if mine.numel() else None


class EpisodeContext:
    """What an episode function gets besides its row: generation on the instance's service,
    tools, the tokenizer and the limits. Built by the rollout worker for each episode."""

    def __init__(self, row: dict[str, Any], *, generate: Callable[[GenerationRequest], Awaitable[RequestResult]],
                 tokenizer: Any, params: SamplingParams, limits: EpisodeLimits, min_version: int, request_id: Any):
        self.row = row  # prompt_ids (list[int]), prompt (text), answer, metadata, seed
        self.tokenizer = tokenizer
        self.params = params
        self.limits = limits
        self._generate = generate
        self._min_version = min_version
        self._request_id = request_id
        self._turn = 0

    @property
    def answer(self) -> str:
        return str(self.row.get(col.ANSWER, ""))

    def start(self) -> Conversation:
        return Conversation(self, list(self.row[col.PROMPT_IDS]))

    async def generate(self, ids: list[int], max_new_tokens: int, stop: list[int], **sampling: Any) -> RequestResult:
        """One model turn from token ids (the whole conversation so far)."""
        return await self._generate(self.next_request(ids, max_new_tokens, stop, **sampling))

    def next_request(self, ids: list[int], max_new_tokens: int, stop: list[int], **sampling: Any) -> GenerationRequest:
        """The generation request of the next model turn: the episode's params, and the seed
        turn k of the row always gets (so a turn samples the same tokens however it is asked)."""
        stop = [*stop, *sampling.pop("stop_token_ids", ())]
        params = dataclasses.replace(self.params, stop_token_ids=tuple(self.params.stop_token_ids) + tuple(stop),
                                     **sampling)
        seed = (int(self.row.get(col.SEED, 0)) * 1_000_003 + self._turn * 7919) % (2 ** 31 - 1)
        req = GenerationRequest((*self._request_id, self._turn), torch.tensor(ids, dtype=torch.long), params, seed,
                                max_new_tokens, self._min_version)
        self._turn += 1
        return req

    def token_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def stop_ids(self, stop: str | list[str] | None) -> list[int]:
        """Stop strings as token ids: each must be one token (the engine stops on token ids)."""
        if stop is None:
            return []
        out = []
        for s in [stop] if isinstance(stop, str) else stop:
            ids = self.token_ids(s)
            if len(ids) != 1:
                raise ValueError(f"stop string {s!r} is {len(ids)} tokens; a stop string must be one token")
            out.append(ids[0])
        return out


class Conversation:
    """The token sequence of one episode, built turn by turn."""

    def __init__(self, ctx: EpisodeContext, prompt_ids: list[int]):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.turn_starts: list[int] = []
        self.finish_reason = ""
        self.metrics: dict[str, float] = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}
        self._last_version = 0
        self.last_turn_eos = False  # the last model turn ended with the end-of-sequence token

    # ---- limits ----------------------------------------------------------------------------
    @property
    def tokens_left(self) -> int:
        return max(0, self.ctx.limits.max_tokens - len(self.ids))

    @property
    def done(self) -> bool:
        """The episode must end: a limit is reached, or a tool asked to end it."""
        if self.finish_reason:
            return True
        if self.metrics["turns"] >= self.ctx.limits.max_turns:
            self.finish_reason = "max_turns"
        elif self.tokens_left <= 0:
            self.finish_reason = "max_tokens"
        return bool(self.finish_reason)

    # ---- turns -----------------------------------------------------------------------------
    async def model(self, *, stop: str | list[str] | None = None, max_new_tokens: int | None = None,
                    **sampling: Any) -> str:
        """Generate a model turn (up to a stop string, EOS or the budget); return its text.
        Raises RuntimeError if called once the episode is done."""
        if self.done:
            raise RuntimeError(f"episode {self.ctx.row.get('prompt', '')!r}: model() after it ended "
                               f"({self.finish_reason}); check conv.done")
        budget = min(self.ctx.params.max_new_tokens if max_new_tokens is None else max_new_tokens, self.tokens_left)
        r = await self.ctx.generate(self.prompt_ids + self.ids, budget, self.ctx.stop_ids(stop), **sampling)
        if r.finish_reason == "error":
            raise RuntimeError(f"episode turn refused by the engine: {r.error}")
        self.turn_starts.append(len(self.ids))
        toks = r.response_ids.tolist()
        self.ids += toks
        self.mask += [1] * len(toks)
        self.log_probs += r.log_probs.float().tolist()
        vers = r.token_versions.tolist()
        self.versions += vers
        if vers:
            self._last_version = int(vers[-1])
        self.metrics["turns"] += 1
        if r.finish_reason == "abort":
            self.finish_reason = "abort"
        # EOS ends the turn; whether it ends the episode is the episode function's call
        self.last_turn_eos = r.finish_reason == "stop" and bool(toks) and toks[-1] == getattr(
            self.ctx.tokenizer, "eos_token_id", None)
        return self.ctx.tokenizer.decode(toks, skip_special_tokens=True)

    def env(self, text: str) -> None:
        """Append text the model did not write (not trained), cut to the token budget."""
        toks = self.ctx.token_ids(text)[:self.tokens_left]
        self.ids += toks
        self.mask += [0] * len(toks)
        self.log_probs += [0.0] * len(toks)
        self.versions += [self._last_version] * len(toks)

    async def tool(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a registered tool and append its output (its policy decides what an error or a
        timeout becomes); return the tool's result (``.text``, ``.ok``, ``.status``)."""
        result = await call_tool(name, *args, **kwargs)
        self.metrics["tool_calls"] += 1
        if not result.ok:
            self.metrics["tool_errors"] += 1
        self.env(result.text)
        if getattr(result, "end_episode", False):
            self.finish_reason = "tool_end"
        return result

    def finish(self, reward: float, **metrics: float) -> Trajectory:
        """The trajectory, scored ``reward``; ``metrics`` are reported per episode."""
        if not self.finish_reason:
            self.finish_reason = "stop"
        return Trajectory(
            response_ids=torch.tensor(self.ids, dtype=torch.long),
            loss_mask=torch.tensor(self.mask, dtype=torch.int8),
            log_probs=torch.tensor(self.log_probs, dtype=torch.float32),
            token_versions=torch.tensor(self.versions, dtype=torch.long),
            turn_starts=list(self.turn_starts), reward=float(reward), finish_reason=self.finish_reason,
            metrics={**self.metrics, **{k: float(v) for k, v in metrics.items()}})
