"""Running episodes on a rollout instance: an asyncio loop on a thread of its own, where every
episode is a task; their model turns go to the instance's ``RolloutService`` as requests, so
they share its running batch with each other (and with plain rows).

An episode function is either ``async def episode(row, ctx) -> Trajectory`` (the
``Conversation`` API) or an agent, ``agent(row, base_url, api_key) -> reward`` (async, or
sync: run on a thread), that talks to the instance's OpenAI-compatible endpoint
(``asyncflow.agents.serving``, started with the first agent episode)."""
from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from .. import column_names as col
from ..engines.rollout.base import GenerationRequest, RequestResult, SamplingParams
from ..engines.rollout.columns import ROLLOUT_OUTPUTS, result_columns
from ..rpc.loop_thread import EventLoopThread
from ..transfer_queue.columns import JaggedColumn
from ..transfer_queue.row_lists import rows, values
from .episode import EpisodeContext, EpisodeLimits, Trajectory
from .serving.spec import is_agent

log = logging.getLogger(__name__)
EPISODE_OUTPUTS = [*ROLLOUT_OUTPUTS, col.LOSS_MASK, col.SCORES, col.EPISODE]
STAT_KEYS = ("episodes", "turns", "tool_calls", "tool_errors")


def load_episode(path: str) -> Callable[..., Any]:
    """The episode function named "package.module:function": an async episode(row, ctx), or an
    agent(row, base_url, api_key)."""
    mod, _, name = str(path).partition(":")
    if not mod or not name:
        raise ValueError(f"episode {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"episode {path!r}: cannot load it: {e}") from e
    if not asyncio.iscoroutinefunction(fn) and not is_agent(fn):
        raise ValueError(f"episode {path!r} must be an async function episode(row, ctx) -> Trajectory, or an "
                         f"agent(row, base_url, api_key) -> reward")
    return fn


def episode_columns(trajs: list[Trajectory], fallback_version: int, outputs: list[str] | None = None) -> dict:
    """An episode stage's output columns, in the order of ``EPISODE_OUTPUTS``: the rollout
    stage's four, then the loss mask, the reward and the episode's metrics."""
    extra = [
        lambda: [t.loss_mask for t in trajs],
        lambda: torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        lambda: [{**t.metrics, "finish_reason": t.finish_reason, "turn_starts": t.turn_starts} for t in trajs],
    ]
    return result_columns(trajs, fallback_version, EPISODE_OUTPUTS if outputs is None else outputs, extra,
                          what="an episode stage")


class EpisodeRunner:
    def __init__(self, service: Any, tokenizer: Any, limits: EpisodeLimits, name: str = "episodes",
                 endpoint: Any = None):
        self.service = service
        self.endpoint = endpoint  # a serving.EndpointSpec: agents may run (None: they are refused)
        self.server: Any = None  # the serving.EndpointServer, started with the first agent episode
        self.agent_host: Any = None  # the serving.AgentHost, with the server where endpoint.agent_process
        self._server_lock: asyncio.Lock | None = None
        self.tokenizer = tokenizer
        self.limits = limits
        self.name = name
        self._loop: EventLoopThread | None = None  # started with the first episode
        self._fns: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()  # episodes start from the stream's and the call queue's threads
        self.stats = dict.fromkeys(STAT_KEYS, 0)  # training episodes only (evaluations are not counted)
        self.finish_reasons: dict[str, int] = {}

    def function(self, path: str) -> Callable[..., Any]:
        with self._lock:
            if path not in self._fns:
                self._fns[path] = load_episode(path)
            return self._fns[path]

    def start(self, path: str, row: dict[str, Any], params: SamplingParams, min_version: int, request_id: Any,
              on_done: Callable[[Trajectory], None] | None = None, count: bool = True) -> Future:
        """Run one episode; its future (and ``on_done``) gets the trajectory. An episode that
        raises gives a trajectory with finish reason "error" and the traceback. ``count``: the
        episode enters the stats (training episodes; evaluations pass False)."""
        fn = self.function(path)
        with self._lock:
            if self._loop is None:
                self._loop = EventLoopThread(name=f"{self.name}-loop")
            loop = self._loop

        async def run() -> Trajectory:
            ctx = EpisodeContext(row, generate=self._generate, tokenizer=self.tokenizer, params=params,
                                 limits=self.limits, min_version=min_version, request_id=request_id)
            try:
                if is_agent(fn):
                    traj = await self._run_agent(fn, path, row, params, min_version, request_id)
                else:
                    traj = await fn(row, ctx)
                if not isinstance(traj, Trajectory):
                    raise TypeError(f"returned {type(traj).__name__}; an episode returns conv.finish(reward)")
            except Exception as e:  # noqa: BLE001 - the stream reports it as this row's error
                traj = _failed(f"episode {path} on prompt {row.get('prompt', '')!r} raised "
                               f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
            if count:
                self._count(traj)
            if on_done is not None:
                on_done(traj)
            return traj
        return asyncio.run_coroutine_threadsafe(run(), loop.loop)

    async def _run_agent(self, fn: Callable[..., Any], path: str, row: dict[str, Any], params: SamplingParams,
                         min_version: int, request_id: Any) -> Trajectory:
        # the endpoint's package imports aiohttp (an optional extra): loaded only by runs that serve agents
        from .serving.agent import run_agent
        from .serving.chat_format import make_format
        server = await self.start_endpoint()
        return await run_agent(fn, row, server=server, service=self.service, tokenizer=self.tokenizer,
                               chat_format=make_format(self.endpoint.chat_format, self.tokenizer), params=params,
                               limits=self.limits, min_version=min_version, request_id=request_id,
                               host=self.agent_host, path=path)

    async def start_endpoint(self) -> Any:
        """The instance's OpenAI-compatible endpoint, started on first use (on the runner's loop)."""
        if self.endpoint is None:
            raise RuntimeError("an agent episode needs the instance's OpenAI endpoint: set "
                               "rollout.openai_endpoint.enabled=true")
        if self._server_lock is None:
            self._server_lock = asyncio.Lock()
        async with self._server_lock:
            if self.server is None:
                from .serving.server import EndpointServer  # aiohttp, as above
                if self.endpoint.agent_process and self.agent_host is None:
                    from .serving.agent_host import AgentHost
                    self.agent_host = await asyncio.to_thread(AgentHost, self.name)
                server = EndpointServer(self.endpoint)
                await server.start()
                self.server = server
        return self.server

    async def _generate(self, req: GenerationRequest) -> RequestResult:
        return await asyncio.wrap_future(self.service.submit(req))

    def _count(self, t: Trajectory) -> None:
        with self._lock:
            self.stats["episodes"] += 1
            for k in ("turns", "tool_calls", "tool_errors"):
                self.stats[k] += int(t.metrics.get(k, 0))
            self.finish_reasons[t.finish_reason] = self.finish_reasons.get(t.finish_reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**self.stats, "finish_reasons": dict(self.finish_reasons)}

    def close(self) -> None:
        if self._loop is not None:
            if self.server is not None:
                try:
                    self._loop.run(self.server.stop(), timeout=10)
                except Exception as e:  # noqa: BLE001 - closing: the loop stops anyway
                    log.warning("%s: the OpenAI endpoint did not stop cleanly: %s", self.name, e)
                self.server = None
            self._loop.stop()
        if self.agent_host is not None:
            self.agent_host.close()
            self.agent_host = None


def _failed(error: str) -> Trajectory:
    empty = torch.zeros(0, dtype=torch.long)
    return Trajectory(empty, torch.zeros(0, dtype=torch.int8), torch.zeros(0), empty, [], 0.0, "error", error=error)


def episode_rows(data: Any, n: int) -> list[dict[str, Any]]:
    """One dict per row from a stage's input data, a TensorDict or a dict of TransferQueue
    columns (prompt ids as a list of ints)."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for key in data.keys():
        column = data[key]
        if key == col.PROMPT_IDS:
            vals = [[int(x) for x in r.tolist()] for r in rows(column)]
        elif isinstance(column, JaggedColumn) or getattr(column, "is_nested", False):
            vals = [r.tolist() for r in rows(column)]
        elif isinstance(column, torch.Tensor):
            vals = column.tolist()
        else:
            vals = values(column)
        for d, v in zip(out, vals):
            d[key] = v
    return out


def show_episode(tokenizer: Any, t: Trajectory) -> str:
    return render_turns(tokenizer, t.response_ids.tolist(), t.loss_mask.tolist())


def render_turns(tokenizer: Any, ids: list[int], mask: list[int]) -> str:
    """A response as text: the model's tokens as they are, tool and environment text in [[...]]."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tokenizer.decode(ids[i:j], skip_special_tokens=False)
        out.append(text if mask[i] else f"[[{text}]]")
        i = j
    return "".join(out)
