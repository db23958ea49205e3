"""A turn's tokens as the engine samples them, and the server-sent-event stream they go out on.

``turn_tokens`` submits the turn with a token listener (RolloutService's ``on_tokens``) and
yields each batch of new tokens on the episode loop as it arrives, then the finished turn.
Leaving it early (the client went away, a write failed) cancels the turn, which aborts its
request on the service (session.py). ``TokenText`` turns the tokens into text as they come."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from collections.abc import Set as AbstractSet
from typing import Any

from aiohttp import web

from .recorder import Turn
from .session import AgentSession

__all__ = ["EventStream", "TokenText", "turn_tokens"]


class TokenText:
    """Completion token ids -> text, a piece at a time. Ids in ``hidden`` (a request's own stop
    strings: the OpenAI API leaves them out of the text) are not shown. A piece that ends in
    the middle of a character (a token holding part of its bytes) is held until the rest comes."""

    def __init__(self, tokenizer: Any, hidden: AbstractSet[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.hidden = hidden
        self.ids: list[int] = []
        self.start = 0  # ids[start:read] are decoded again as context for the next piece
        self.read = 0  # ids before this are in the text given out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def feed(self, ids: list[int], final: bool = False) -> str:
        self.ids += [t for t in ids if t not in self.hidden]
        before = self._decode(self.ids[self.start:self.read])
        now = self._decode(self.ids[self.start:])
        if (now.endswith("\ufffd") and not final) or len(now) <= len(before):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return now[len(before):]

    def finish(self) -> str:
        return self.feed([], final=True)

    def whole(self, ids: list[int]) -> str:
        """The text of a whole completion: what ``feed(ids)`` then ``finish()`` give, in one decode."""
        return self._decode([t for t in ids if t not in self.hidden])


async def turn_tokens(session: AgentSession, *args: Any) -> AsyncGenerator[tuple[list[int], list[float]] | Turn, None]:
    """``session.generate(*args)`` streamed: (token ids, log-probs) batches, then the Turn.
    Use it under ``contextlib.aclosing``: closing it early aborts the turn."""
    loop = asyncio.get_running_loop()
    batches: asyncio.Queue = asyncio.Queue()

    def on_tokens(ids: list[int], log_probs: list[float]) -> None:  # on the service thread
        loop.call_soon_threadsafe(batches.put_nowait, (ids, log_probs))

    task = asyncio.ensure_future(session.generate(*args, on_tokens=on_tokens))
    # the service hands over every token before the result, so the end marker comes after them all
    task.add_done_callback(lambda _: batches.put_nowait(None))
    try:
        while (batch := await batches.get()) is not None:
            yield batch
        yield await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class EventStream:
    """A server-sent-event stream of JSON chunks, ended by ``[DONE]``. With ``include_usage``
    every chunk carries ``usage: null`` and the last one the usage (stream_options)."""

    def __init__(self, request: web.Request, include_usage: bool) -> None:
        self.request = request
        self.include_usage = include_usage
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def open(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: dict) -> None:
        if self.include_usage:
            obj = {**obj, "usage": obj.get("usage")}
        await self.resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def fail(self, error: dict) -> web.StreamResponse:
        """An error after the stream began (the status is sent already): an error event, no [DONE]."""
        await self.resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await self.resp.write_eof()
        return self.resp

    async def close(self) -> web.StreamResponse:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp
