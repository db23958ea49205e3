"""Running one agent episode: a key of its own, the agent (async, or sync on a thread), then
the trajectory from what its requests recorded. The key is revoked when the agent returns,
raises or passes ``max_time_s`` (then the episode ends with finish reason "time_limit" and
reward 0: a sync agent's thread cannot be stopped, but nothing it sends is accepted any more);
requests it left running are aborted. The agent runs on the instance's episode loop, or in the
agent process (agent_host.py)."""
from __future__ import annotations

import asyncio
import numbers
from collections.abc import Callable
from typing import Any

from ...engines.rollout.base import SamplingParams
from ...rpc.waits import wait_within
from ..episode import EpisodeLimits, Trajectory
from .chat_format import ChatFormat
from .recorder import build_trajectory
from .server import EndpointServer
from .session import AgentSession
from .threads import on_own_thread

__all__ = ["run_agent"]


async def run_agent(fn: Callable[..., Any], row: dict[str, Any], *, server: EndpointServer, service: Any,
                    tokenizer: Any, chat_format: ChatFormat, params: SamplingParams, limits: EpisodeLimits,
                    min_version: int, request_id: Any, host: Any = None, path: str = "") -> Trajectory:
    """``host`` (an AgentHost): the agent ``path`` runs in the agent process, not on this loop."""
    session = AgentSession(row, service=service, tokenizer=tokenizer, chat_format=chat_format, params=params,
                           limits=limits, min_version=min_version, request_id=request_id,
                           run_sampling=server.spec.run_sampling)
    key = server.keys.issue(session, limits.max_time_s)
    finish = None
    try:
        if host is not None:
            call = host.run(path, row, server.base_url, key)
        elif asyncio.iscoroutinefunction(fn):
            call = fn(row, server.base_url, key)
        else:
            call = on_own_thread(fn, row, server.base_url, key)
        try:
            reward = await wait_within(call, limits.max_time_s)
        except TimeoutError:
            reward, finish = 0.0, "time_limit"
    finally:
        server.keys.revoke(key)
        await session.close()
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"an agent returns its reward as a number, got {type(reward).__name__}")
    return build_trajectory(session.record, float(reward), limits, finish)

