"""Per-episode limits on an agent's requests (``EpisodeLimits``): at most ``max_turns``
requests, ``max_tokens`` tokens after the row's prompt (every completion is cut to what is
left), and ``max_time_s`` of wall time (the episode's key expires then). A request over a limit
is refused with the OpenAI error format and is not recorded."""
from __future__ import annotations

from ..episode import EpisodeLimits

__all__ = ["LimitExceeded", "MAX_BODY_BYTES", "completion_budget"]

MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused (413)


class LimitExceeded(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def completion_budget(limits: EpisodeLimits, requests_done: int, prompt_len: int, row_prompt_len: int,
                      asked: int | None, default: int) -> int:
    """How many tokens this request may generate; raises LimitExceeded when it may not run."""
    if requests_done >= limits.max_turns:
        raise LimitExceeded("episode_request_limit", f"this episode has made its {limits.max_turns} requests "
                            f"(agent.max_turns)")
    left = limits.max_tokens - max(0, prompt_len - row_prompt_len)
    if left <= 0:
        raise LimitExceeded("episode_token_limit", f"this episode's conversation has {prompt_len - row_prompt_len} "
                            f"tokens after its prompt; agent.max_tokens is {limits.max_tokens}")
    want = default if asked is None else asked
    return max(0, min(want, left))
