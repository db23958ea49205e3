"""What an instance's endpoint is (address, chat format) and which episode functions are agents."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AGENT_PARAMS", "EndpointSpec", "endpoint_spec", "is_agent"]

# An agent's signature: agent(row, base_url, api_key) -> reward (async, or sync: run on a thread)
AGENT_PARAMS = ("row", "base_url", "api_key")


@dataclass(frozen=True)
class EndpointSpec:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    chat_format: str = "plain"  # plain | template (chat_format.py)
    model_name: str = "policy"  # what /v1/models lists; a request's "model" field is not checked
    # the run's rollout (temperature, top_p, top_k): values a request may name besides its episode's own
    # (an evaluation episode samples greedily whatever its agent names); None: the episode's only
    run_sampling: tuple[float, float, int] | None = None
    agent_process: bool = False  # agents run in a child process of their own (agent_host.py)


def endpoint_spec(cfg: Any, rank: int) -> EndpointSpec | None:
    """The endpoint of the instance on ``rank`` from a RunConfig (None when it is off)."""
    e = cfg.rollout.openai_endpoint
    if not e.enabled:
        return None
    fmt = e.chat_format if e.chat_format != "auto" else ("template" if cfg.data.chat_template else "plain")
    r = cfg.rollout
    return EndpointSpec(host=e.host, port=e.port + rank if e.port else 0, chat_format=fmt,
                        run_sampling=(float(r.temperature), float(r.top_p), int(r.top_k)),
                        agent_process=bool(e.agent_process))


def is_agent(fn: Callable[..., Any]) -> bool:
    """An episode function whose parameters are (row, base_url, api_key)."""
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == AGENT_PARAMS and len(names) == 3
