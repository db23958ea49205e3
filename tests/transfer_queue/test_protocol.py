"""The TransferQueue Protocols and the clients that implement them: every Protocol method exists
on its client, a coroutine function exactly where the Protocol's is, with the same parameters
(names, kinds, defaults), so code written against the Protocol calls the client as it is."""
from __future__ import annotations

import inspect

import pytest

from asyncflow.transfer_queue import (
    AsyncTransferQueue,
    AsyncTransferQueueClient,
    TransferQueue,
    TransferQueueClient,
)


def _members(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("proto, client", [(AsyncTransferQueue, AsyncTransferQueueClient),
                                           (TransferQueue, TransferQueueClient)])
def test_the_client_has_every_protocol_method_with_its_parameters(proto, client):
    names = _members(proto)
    assert {"put", "get_meta", "close"} <= set(names), names
    for name in names:
        want, got = getattr(proto, name), getattr(client, name, None)
        assert got is not None, f"{client.__name__} lacks {name}"
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
        assert _params(got) == _params(want), name

