"""The HTTP routes (aiohttp): /v1/models, /v1/chat/completions and /v1/completions, streamed
(server-sent events) or not. Every route needs an episode's key (``Authorization: Bearer``);
without a valid one the request is refused (401) before its body is read. Errors come back in
the OpenAI format (errors.py).

A stream sends the role chunk at once, then the completion when the engine has finished it
(the service returns a request's tokens when it finishes), then ``[DONE]``. A client that goes
away mid-request cancels its handler (``handler_cancellation``), and the request is aborted on
the service (session.py)."""
from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from .bodies import parse_chat, parse_completion
from .chat_format import FormatError, Reply
from .errors import ApiError, error_body
from .keys import EpisodeKeys
from .limits import MAX_BODY_BYTES, LimitExceeded
from .session import AgentSession

__all__ = ["make_app"]

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


async def _generate(session: AgentSession, *args: Any) -> tuple[Any, str]:
    try:
        return await session.generate(*args)
    except ValueError as e:  # a stop string of several tokens
        raise ApiError(400, str(e), param="stop") from None
    except RuntimeError as e:
        raise ApiError(400, str(e), code="engine_refused") from None


def _usage(turn: Any) -> dict[str, int]:
    p, c = len(turn.prompt_ids), len(turn.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish(turn: Any, reply: Reply | None = None) -> str:
    if reply is not None and reply.tool_calls:
        return "tool_calls"
    return "length" if turn.finish_reason == "length" else "stop"


def _fingerprint(turn: Any) -> str:
    return f"asyncflow-v{max(turn.versions) if turn.versions else 0}"  # the policy version that answered


def _token_logprobs(session: AgentSession, turn: Any) -> list[dict]:
    return [{"token": session.tokenizer.decode([t], skip_special_tokens=False), "logprob": lp, "bytes": None,
             "top_logprobs": []} for t, lp in zip(turn.completion_ids, turn.log_probs)]


class _Events:
    """A server-sent-event stream of JSON chunks."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def open(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: dict) -> None:
        await self.resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def close(self) -> web.StreamResponse:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    session: AgentSession = request["session"]
    req = parse_chat(await _body(request))
    try:
        text, starts = session.format.render(req.messages, req.tools)
    except FormatError as e:
        session.record.refused += 1
        raise ApiError(400, str(e), param="messages") from None
    prompt_ids = session.prompt_ids(text)
    budget = _admit(session, prompt_ids, req.max_tokens)
    stop = session.format.stop(req.tools) + req.stop
    base = {"id": f"chatcmpl-{session.admitted}-{id(session):x}", "created": int(time.time()),
            "model": request.app[MODEL]}
    events = None
    if req.stream:
        events = _Events(request)
        await events.open()
        await events.send({**base, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    turn, out = await _generate(session, prompt_ids, budget, stop, text, starts)
    reply = session.format.parse(out, req.tools)
    turn.tool_calls = len(reply.tool_calls)
    logprobs = {"content": _token_logprobs(session, turn)} if req.logprobs else None
    calls = [c.to_openai() for c in reply.tool_calls]
    if events is None:
        message = {"role": "assistant", "content": reply.content, **({"tool_calls": calls} if calls else {})}
        return web.json_response({**base, "object": "chat.completion", "system_fingerprint": _fingerprint(turn),
                                  "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                               "finish_reason": _finish(turn, reply)}],
                                  "usage": _usage(turn)})
    chunk = {**base, "object": "chat.completion.chunk", "system_fingerprint": _fingerprint(turn)}
    if reply.content:
        await events.send({**chunk, "choices": [{"index": 0, "delta": {"content": reply.content},
                                                 "logprobs": logprobs, "finish_reason": None}]})
    if calls:
        await events.send({**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, **c} for i, c in enumerate(calls)]}, "finish_reason": None}]})
    await events.send({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(turn, reply)}]})
    if req.include_usage:
        await events.send({**chunk, "choices": [], "usage": _usage(turn)})
    return await events.close()


async def completions(request: web.Request) -> web.StreamResponse:
    session: AgentSession = request["session"]
    req = parse_completion(await _body(request))
    if isinstance(req.prompt, str):
        text, prompt_ids = req.prompt, session.prompt_ids(req.prompt)
    else:
        prompt_ids = list(req.prompt)
        text = session.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    budget = _admit(session, prompt_ids, req.max_tokens)
    base = {"id": f"cmpl-{session.admitted}-{id(session):x}", "created": int(time.time()),
            "model": request.app[MODEL], "object": "text_completion"}
    events = None
    if req.stream:
        events = _Events(request)
        await events.open()
    turn, out = await _generate(session, prompt_ids, budget, req.stop, text, [0])
    logprobs = None
    if req.logprobs:
        entries = _token_logprobs(session, turn)
        logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": None, "text_offset": None}
    choice = {"index": 0, "text": out, "logprobs": logprobs, "finish_reason": _finish(turn)}
    if events is None:
        return web.json_response({**base, "system_fingerprint": _fingerprint(turn), "choices": [choice],
                                  "usage": _usage(turn)})
    await events.send({**base, "choices": [choice]})
    if req.include_usage:
        await events.send({**base, "choices": [], "usage": _usage(turn)})
    return await events.close()
