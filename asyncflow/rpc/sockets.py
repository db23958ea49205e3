"""ZMQ socket steps that both servers and clients take: send without blocking, hand every
message that has arrived to a handler, stop an event loop watching a socket."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger(__name__)


# Plain ints on the hot path: flag arithmetic on zmq's enum members goes through the enum's
# Python-level operators on every use.
EVENTS, POLLIN, POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


def send_nowait(sock: Any, frames: list[Any]) -> bool:
    """Send without blocking; False when the pipe is full (the caller keeps the message)."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:  # the high-water mark: retried when there is room
        return False


def drain(sock: Any, handle: Callable[[list[Any]], None], name: str, kind: str) -> None:
    """Hand every message that has arrived on ``sock`` to ``handle``, one by one, until none
    is left. recv and EVENTS let libzmq take in what its I/O thread signalled; the fd wakes
    the loop again on the next change only once nothing is left to read here."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a wake-up for something else (room to send, or nothing)
            return
        try:
            handle(frames)
        except Exception:  # never let one message stop the reader
            log.exception("%s: error handling a %s", name, kind)
        if sock.closed or not sock.getsockopt(EVENTS) & POLLIN:
            return


def unwatch(loop: asyncio.AbstractEventLoop | None, sock: Any, fd: int) -> None:
    """Stop the loop watching a socket's fd (before the socket is closed)."""
    if loop is not None and not loop.is_closed() and not sock.closed:
        try:
            loop.remove_reader(fd)
        except Exception:  # noqa: BLE001 - the loop is going away anyway
            pass
