"""Fixtures for TransferQueue tests: a real service (controller + storage units in a
private event-loop thread) and sync clients talking to it over ZMQ.

An async client calls a service of its own process directly (``rpc.thread_endpoint``) unless
told not to: every test that makes one (``tq.async_client()``) runs twice, over the socket
and direct (``async_path``), so that both paths keep the same behaviour.

Every wait in these tests has a short timeout so that a bug shows up as a failure,
never as a hung suite.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq.asyncio
from _tq_helpers import RPC_TIMEOUT, WAIT_TIMEOUT

from asyncflow.transfer_queue import (
    AsyncTransferQueueClient,
    TransferQueueClient,
    TransferQueueConfig,
    TransferQueueService,
)


@dataclass
class TQ:
    """A running service and a sync client connected to it."""
    service: TransferQueueService
    client: TransferQueueClient
    _extra: list = field(default_factory=list)
    async_direct: bool = False  # how async_client() reaches the service: directly, or over a socket

    @property
    def address(self) -> str:
        return self.service.controller_address

    @property
    def controller(self):
        return self.service.controller

    def new_client(self, **kw: Any) -> TransferQueueClient:
        kw = {"timeout": RPC_TIMEOUT, "wait_timeout": WAIT_TIMEOUT, **kw}
        c = TransferQueueClient(self.address, **kw)
        self._extra.append(c)
        return c

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` inside the service's event loop (the only thread that touches its state)."""
        async def call():
            return fn()
        return self.service._thread.run(call(), timeout=RPC_TIMEOUT)

    def async_client(self, **kw: Any) -> AsyncTransferQueueClient:
        """An async client for use inside ``asyncio.run``; close it with ``await c.close()``."""
        kw = {"timeout": RPC_TIMEOUT, "wait_timeout": WAIT_TIMEOUT, "direct": self.async_direct, **kw}
        return AsyncTransferQueueClient(self.address, ctx=zmq.asyncio.Context(), **kw)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that makes an async client runs over both paths (see the module's docstring)."""
    if "async_path" in metafunc.fixturenames:
        return  # the test chose its own
    if "tq_factory" in metafunc.fixturenames and "async_client(" in inspect.getsource(metafunc.function):
        metafunc.fixturenames.append("async_path")
        metafunc.parametrize("async_path", ["socket", "direct"])


@pytest.fixture
def async_path() -> str:
    """How async clients reach the service (parametrized by pytest_generate_tests)."""
    return "socket"


@pytest.fixture
def tq_factory(request: pytest.FixtureRequest):
    """``make(**TransferQueueConfig fields) -> TQ``; everything is stopped at teardown."""
    made: list[TQ] = []
    direct = "async_path" in request.fixturenames and request.getfixturevalue("async_path") == "direct"

    def make(**cfg: Any) -> TQ:
        cfg = {"wait_timeout_s": WAIT_TIMEOUT, **cfg}
        svc = TransferQueueService(TransferQueueConfig(**cfg)).start_in_thread()
        client = TransferQueueClient(svc.controller_address, timeout=RPC_TIMEOUT, wait_timeout=WAIT_TIMEOUT)
        t = TQ(svc, client, async_direct=direct)
        made.append(t)
        return t

    yield make
    for t in made:
        for c in [t.client, *t._extra]:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - teardown must reach every service
                pass
        t.service.stop_in_thread()


@pytest.fixture
def tq(tq_factory) -> TQ:
    """A service with one in-process storage unit."""
    return tq_factory()

