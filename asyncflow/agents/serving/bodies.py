"""The bodies of /v1/chat/completions and /v1/completions, checked: what the endpoint reads
of them. Sampling fields (temperature, top_p, ...) are accepted and not used: an episode
samples with the run's rollout settings (greedy in evaluation), which are what the trainer's
importance ratios assume."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ApiError

__all__ = ["ChatRequest", "CompletionRequest", "parse_chat", "parse_completion"]


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool


def _common(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, f"n must be 1 (one completion per request), got {n!r}", param="n")
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise ApiError(400, f"max_tokens must be a positive integer, got {asked!r}", param="max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    return {"max_tokens": asked, "stop": stop, "stream": stream,
            "include_usage": bool(isinstance(options, dict) and options.get("include_usage")),
            "logprobs": bool(body.get("logprobs"))}


def parse_chat(body: Any) -> ChatRequest:
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", param="tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice: only 'auto' and 'none' are supported", param="tool_choice")
    if body.get("tool_choice") == "none":
        tools = None
    return ChatRequest(messages=messages, tools=tools or None, **common)


def parse_completion(body: Any) -> CompletionRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ok = isinstance(prompt, str) and prompt or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    return CompletionRequest(prompt=prompt, **common)
