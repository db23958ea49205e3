"""The HTTP routes (aiohttp): /v1/models, /v1/chat/completions and /v1/completions, streamed
(server-sent events) or not. Every route needs an episode's key (``Authorization: Bearer``);
without a valid one the request is refused (401) before its body is read. Errors come back in
the OpenAI format (errors.py).

A stream sends the role chunk at once, then the completion as the engine samples it: content
as soon as the chat format knows it is not part of a tool call, a tool call once its text is
complete (streaming.py, chat_format.py), then the finish reason, the usage if asked and
``[DONE]``. A client that goes away mid-request cancels its handler (``handler_cancellation``),
or its next write fails, and the request is aborted on the service (session.py)."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .bodies import parse_chat, parse_completion
from .chat_format import FormatError, Reply, ToolCall
from .errors import ApiError, error_body
from .keys import EpisodeKeys
from .limits import MAX_BODY_BYTES, LimitExceeded
from .recorder import Turn
from .session import AgentSession
from .streaming import EventStream, TokenText, turn_tokens

__all__ = ["make_app"]

Stop = tuple[list[int], set[int]]  # a request's stop token ids, and those its text leaves out

KEYS = web.AppKey("keys", EpisodeKeys)
MODEL = web.AppKey("model", str)


def make_app(keys: EpisodeKeys, model_name: str) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=MAX_BODY_BYTES)
    app[KEYS] = keys
    app[MODEL] = model_name
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app


def _json_error(e: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return web.json_response(e.body(), status=e.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _json_error(e)
    except web.HTTPException as e:  # unknown route, wrong method, body too large
        if e.status < 400:
            raise
        return web.json_response(error_body(e.status, e.reason or "error"), status=e.status)


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    header = request.headers.get("Authorization", "")
    key = header[7:].strip() if header.lower().startswith("bearer ") else ""
    session = request.app[KEYS].lookup(key)
    if session is None:
        raise ApiError(401, "no valid episode key: every request must come from a running episode, with the "
                       "key its agent was given (an episode's key expires when the episode ends)",
                       code="invalid_api_key")
    request["session"] = session
    return await handler(request)


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[MODEL], "object": "model", "created": 0, "owned_by": "asyncflow"}]})


def _admit(session: AgentSession, prompt_ids: list[int], asked: int | None) -> int:
    try:
        return session.budget(prompt_ids, asked)
    except LimitExceeded as e:
        raise ApiError(400, str(e), code=e.code) from None


def _stop(session: AgentSession, own: list[str], asked: list[str]) -> Stop:
    """The stop token ids of a request: the chat format's (kept in the text, which the format
    reads) and the request's (left out of the text, as the OpenAI API does)."""
    try:
        own_ids, asked_ids = session.stop_ids(own), session.stop_ids(asked)
    except ValueError as e:  # a stop string of several tokens
        raise ApiError(400, str(e), param="stop") from None
    return own_ids + asked_ids, set(asked_ids) - set(own_ids)


async def _generate(session: AgentSession, *args: Any, on_tokens: Any = None) -> Turn:
    try:
        return await session.generate(*args, on_tokens=on_tokens)
    except RuntimeError as e:
        raise ApiError(400, str(e), code="engine_refused") from None


def _usage(turn: Turn) -> dict[str, int]:
    p, c = len(turn.prompt_ids), len(turn.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish(turn: Turn, reply: Reply | None = None) -> str:
    if reply is not None and reply.tool_calls:
        return "tool_calls"
    return "length" if turn.finish_reason == "length" else "stop"


def _fingerprint(turn: Turn) -> str:
    return f"asyncflow-v{max(turn.versions) if turn.versions else 0}"  # the policy version that answered


def _token_logprobs(session: AgentSession, ids: list[int], log_probs: list[float]) -> list[dict]:
    return [{"token": session.tokenizer.decode([t], skip_special_tokens=False), "logprob": lp, "bytes": None,
             "top_logprobs": []} for t, lp in zip(ids, log_probs)]


def _completion_logprobs(session: AgentSession, ids: list[int], log_probs: list[float]) -> dict:
    entries = _token_logprobs(session, ids, log_probs)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": None, "text_offset": None}


def _calls(calls: list[ToolCall], first: int) -> list[dict]:
    return [{"index": first + i, **c.to_openai()} for i, c in enumerate(calls)]


async def _streamed(session: AgentSession, args: tuple, words: TokenText, events: EventStream,
                    send_piece: Callable[[str, list[int], list[float]], Awaitable[None]]) -> Turn | None:
    """The turn streamed: ``send_piece(text, ids, log_probs)`` for each batch of tokens the engine
    samples (``text``: what the batch adds to the completion's text), then the finished Turn; None
    when it failed mid-stream (the error event is sent, the response ended)."""
    try:
        async with contextlib.aclosing(turn_tokens(session, *args)) as tokens:
            async for item in tokens:
                if isinstance(item, Turn):
                    return item
                ids, lps = item
                await send_piece(words.feed(ids), ids, lps)
    except ApiError as e:
        await events.fail(e.body())
        return None
    raise RuntimeError("the turn's token stream ended without the turn")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    session: AgentSession = request["session"]
    req = parse_chat(await _body(request), session.sampling)
    try:
        text, starts = session.format.render(req.messages, req.tools)
        reader = session.format.reader(req.tools)
    except FormatError as e:
        session.record.refused += 1
        raise ApiError(400, str(e), param="messages") from None
    prompt_ids = session.prompt_ids(text)
    stop_ids, hidden = _stop(session, session.format.stop(req.tools), req.stop)
    budget = _admit(session, prompt_ids, req.max_tokens)
    base = {"id": f"chatcmpl-{session.admitted}-{id(session):x}", "created": int(time.time()),
            "model": request.app[MODEL]}
    args = (prompt_ids, budget, stop_ids, text, starts)
    words = TokenText(session.tokenizer, hidden)
    if not req.stream:
        turn = await _generate(session, *args)
        reader.feed(words.whole(turn.completion_ids))
        reply = reader.finish()[2]
        logprobs = {"content": _token_logprobs(session, turn.completion_ids, turn.log_probs)} if req.logprobs else None
        openai_calls = [c.to_openai() for c in reply.tool_calls]
        turn.tool_calls = len(openai_calls)
        message = {"role": "assistant", "content": reply.content,
                   **({"tool_calls": openai_calls} if openai_calls else {})}
        return web.json_response({**base, "object": "chat.completion", "system_fingerprint": _fingerprint(turn),
                                  "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                               "finish_reason": _finish(turn, reply)}],
                                  "usage": _usage(turn)})
    chunk = {**base, "object": "chat.completion.chunk"}
    events = EventStream(request, req.include_usage)
    await events.open()
    await events.send({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})

    async def piece(content: str, calls: list[ToolCall], logprobs: list[dict] | None) -> None:
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _calls(calls, len(reader.calls) - len(calls))
        if delta or logprobs:
            await events.send({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                                     "logprobs": {"content": logprobs} if logprobs else None}]})

    async def tokens(text: str, ids: list[int], lps: list[float]) -> None:
        await piece(*reader.feed(text), _token_logprobs(session, ids, lps) if req.logprobs else None)
    streamed = await _streamed(session, args, words, events, tokens)
    if streamed is None:
        return events.resp
    turn = streamed
    content, calls = reader.feed(words.finish())
    await piece(content, calls, None)
    content, calls, reply = reader.finish()
    await piece(content, calls, None)
    turn.tool_calls = len(reply.tool_calls)
    chunk["system_fingerprint"] = _fingerprint(turn)
    await events.send({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                             "finish_reason": _finish(turn, reply)}]})
    if req.include_usage:
        await events.send({**chunk, "choices": [], "usage": _usage(turn)})
    return await events.close()


async def completions(request: web.Request) -> web.StreamResponse:
    session: AgentSession = request["session"]
    req = parse_completion(await _body(request), session.sampling)
    if isinstance(req.prompt, str):
        text, prompt_ids = req.prompt, session.prompt_ids(req.prompt)
    else:
        prompt_ids = list(req.prompt)
        text = session.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    stop_ids, hidden = _stop(session, [], req.stop)
    budget = _admit(session, prompt_ids, req.max_tokens)
    base = {"id": f"cmpl-{session.admitted}-{id(session):x}", "created": int(time.time()),
            "model": request.app[MODEL], "object": "text_completion"}
    args = (prompt_ids, budget, stop_ids, text, [0])
    words = TokenText(session.tokenizer, hidden)
    if not req.stream:
        turn = await _generate(session, *args)
        out = words.whole(turn.completion_ids)
        logprobs = _completion_logprobs(session, turn.completion_ids, turn.log_probs) if req.logprobs else None
        return web.json_response({**base, "system_fingerprint": _fingerprint(turn), "usage": _usage(turn),
                                  "choices": [{"index": 0, "text": out, "logprobs": logprobs,
                                               "finish_reason": _finish(turn)}]})
    events = EventStream(request, req.include_usage)
    await events.open()

    async def piece(text: str, ids: list[int], lps: list[float]) -> None:
        if text or req.logprobs:
            logprobs = _completion_logprobs(session, ids, lps) if req.logprobs else None
            await events.send({**base, "choices": [{"index": 0, "text": text, "finish_reason": None,
                                                    "logprobs": logprobs}]})
    streamed = await _streamed(session, args, words, events, piece)
    if streamed is None:
        return events.resp
    turn = streamed
    await events.send({**base, "system_fingerprint": _fingerprint(turn), "choices": [
        {"index": 0, "text": words.finish(), "logprobs": None, "finish_reason": _finish(turn)}]})
    if req.include_usage:
        await events.send({**base, "choices": [], "usage": _usage(turn)})
    return await events.close()
