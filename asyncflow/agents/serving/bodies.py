"""The bodies of /v1/chat/completions and /v1/completions, checked: what the endpoint reads
of them, and what it refuses. The rule for each field (docs/agents_openai.md):

- honoured: messages, tools, tool_choice (auto, none), max_tokens / max_completion_tokens
  (cut to the episode's budget), stop (one token each), stream, stream_options.include_usage,
  logprobs (the sampled tokens' behaviour log-probs);
- the run's, not the request's: temperature, top_p, top_k. The episode samples with the run's
  rollout settings, which are what the trainer's importance ratios are computed at; a request
  may name them (or leave them out), a request that asks for other values is refused, naming
  the field, rather than served with a sampler it did not ask for;
- seed: accepted and not used: every turn gets the seed of its row and turn (a fixed seed in
  an agent would make a GRPO group's episodes all alike);
- refused unless at their neutral value: n (1), top_logprobs (0), a completion's logprobs
  above 0, best_of, echo, suffix, penalties, logit_bias, a response_format other than text:
  the engine does not compute them, and serving the request without them would be a silent
  change of what the agent asked for;
- read and not used: model, user, metadata, store, service_tier, parallel_tool_calls,
  prompt_cache_key, safety_identifier;
- any other field is refused (400, ``param`` names it), as OpenAI refuses arguments it does
  not know: a misspelt or engine-specific sampling field never goes unnoticed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

__all__ = ["ChatRequest", "CompletionRequest", "RunSampling", "accepted_sampling", "parse_chat", "parse_completion"]

# read and not used: they change nothing the endpoint does
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier", "seed"}
_COMMON = {"max_tokens", "stop", "stream", "stream_options", "logprobs", "n", "temperature", "top_p", "top_k",
           "frequency_penalty", "presence_penalty", "logit_bias"} | _IGNORED
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "max_completion_tokens", "top_logprobs",
                         "response_format", "modalities"}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
# fields the endpoint cannot honour, accepted at these (neutral) values only
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "top_logprobs": (0,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "response_format": ({"type": "text"},),
    "modalities": (["text"],)}
_WHY = {"n": "one completion per request: an episode is one conversation (rollout.n makes the group)",
        "top_logprobs": "the engine returns the sampled tokens' log-probs only, not the top alternatives",
        "best_of": "one completion per request", "echo": "the prompt is not returned",
        "suffix": "no insertion", "frequency_penalty": "the run's sampler has no penalties",
        "presence_penalty": "the run's sampler has no penalties", "logit_bias": "the run's sampler has no bias",
        "response_format": "no constrained decoding: the model writes text", "modalities": "text only"}


@dataclass(frozen=True)
class RunSampling:
    """The sampling values a request may name: the run's (rollout.*) and the episode's own
    (evaluation samples greedily). Whatever a request names, the episode's are used."""
    temperature: tuple[float, ...] = ()
    top_p: tuple[float, ...] = ()
    top_k: tuple[int, ...] = ()


def accepted_sampling(temperature: float, top_p: float, top_k: int,
                      run: tuple[float, float, int] | None = None) -> RunSampling:
    """The values a request may name: the episode's (``temperature``, ...) and the run's."""
    both = [(temperature, top_p, top_k)] + ([run] if run is not None else [])
    return RunSampling(tuple(sorted({float(v[0]) for v in both})), tuple(sorted({float(v[1]) for v in both})),
                       tuple(sorted({int(v[2]) for v in both})))


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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise ApiError(400, f"unrecognized request argument supplied: {name} (the endpoint refuses fields it "
                           "does not know rather than ignore them; docs/agents_openai.md lists what it reads)",
                           param=name)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise ApiError(400, f"{name}={value!r} is not supported ({_WHY[name]}); leave it out or send "
                           f"{neutral[0]!r}", param=name)


def _check_sampling(body: dict, run: RunSampling) -> None:
    for name, allowed in (("temperature", run.temperature), ("top_p", run.top_p), ("top_k", run.top_k)):
        value = body.get(name)
        if value is None or not allowed:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
        if not any(abs(float(value) - a) <= 1e-6 for a in allowed):
            shown = " or ".join(f"{a:g}" for a in allowed)
            raise ApiError(400, f"{name}={value:g} differs from the run's sampling ({name} {shown}): an episode "
                           f"samples with the run's settings (rollout.{name}), the ones the trainer's importance "
                           f"ratios assume; leave {name} out or send the run's value", param=name)


def _common(body: Any, known: set[str], run: RunSampling) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, known)
    _check_sampling(body, run)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(name)
    if asked is not None and (not _is_int(asked) or asked < 1):
        raise ApiError(400, f"{name} must be a positive integer, got {asked!r}", param=name)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, f"seed must be an integer, got {seed!r}", param="seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage",
                                                                                  "include_obfuscation"}):
        raise ApiError(400, "stream_options: only include_usage is read", param="stream_options")
    return {"max_tokens": asked, "stop": stop, "stream": stream,
            "include_usage": bool(options and options.get("include_usage"))}


def parse_chat(body: Any, run: RunSampling = RunSampling()) -> ChatRequest:
    common = _common(body, CHAT_FIELDS, run)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
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
    return ChatRequest(messages=messages, tools=tools or None, logprobs=bool(logprobs), **common)


def parse_completion(body: Any, run: RunSampling = RunSampling()) -> CompletionRequest:
    common = _common(body, COMPLETION_FIELDS, run)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
        raise ApiError(400, f"logprobs={logprobs!r} is not supported: logprobs=0 returns the sampled tokens' "
                       "log-probs; the engine does not compute the top alternatives", param="logprobs")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ok = isinstance(prompt, str) and prompt or (
        isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt))
    if not ok:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    return CompletionRequest(prompt=prompt, logprobs=logprobs is not None, **common)
