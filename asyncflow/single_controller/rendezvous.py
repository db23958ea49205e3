"""Finding each other: the TCPStore torchrun already runs, and the interface to bind.

Every rank publishes its worker's ZMQ address under ``asyncflow/worker/<rank>``; the
driver waits for all of them. The run's message-authentication key travels the same way
(``asyncflow/run_key``). No second coordination service.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ..rpc import auth
from .errors import LaunchError

KEY_PREFIX = "asyncflow/"
# Set in the ranks that single_controller/supervise.py starts: its launcher takes restart requests.
SUPERVISED_ENV = "ASYNCFLOW_SUPERVISED"


def connect_store(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                  use_agent_store: bool | None = None) -> dist.TCPStore:
    """The run's TCPStore, as torch's env:// rendezvous finds it.

    Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent hosts it and every rank
    is a client; otherwise rank 0 hosts it at MASTER_ADDR:MASTER_PORT.
    """
    if use_agent_store is None:
        use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return dist.TCPStore(host, port, world_size, is_master=(rank == 0 and not use_agent_store),
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:
        raise LaunchError(f"rank {rank}: cannot reach the TCPStore at {host}:{port} within {timeout_s:.0f}s: "
                          f"{e}") from e


def rendezvous_host(master_addr: str) -> str:
    """The local interface that routes to ``master_addr`` (loopback for a local run).

    Binding there, never to 0.0.0.0, keeps the worker off interfaces the run does not use.
    """
    try:
        ip = socket.gethostbyname(master_addr)
    except OSError as e:
        raise LaunchError(f"cannot resolve MASTER_ADDR {master_addr!r}: {e}") from e
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # UDP connect sends nothing
        s.connect((ip, 9))
        host: str = s.getsockname()[0]  # an AF_INET socket's name: (host, port)
        return host


def share_run_key(store: dist.Store, rank: int, timeout_s: float) -> bytes:
    """Agree on the run's secret key through the store and install it in this process.

    Rank 0 sets a new key unless one is there already (compare-and-set: a parent that
    hosts the store, as ``LocalWorkers`` does, may have put its own first); every other
    rank waits for it. Call before any RPC server or client is made. Under torchrun the
    store is the agent's, shared by every rank of every node, so global rank 0 decides.
    """
    if rank == 0:
        # torch's stub types the values str; the binding takes bytes (the key is binary)
        key = store.compare_set(auth.STORE_KEY, b"", auth.generate_key())  # type: ignore[arg-type]
    else:
        key = wait_run_key(store, timeout_s, f"rank {rank}")
    auth.set_run_key(key)
    return key


def wait_run_key(store: dist.Store, timeout_s: float, who: str = "this process") -> bytes:
    """The run key from the store, waiting up to ``timeout_s`` for rank 0 to put it there."""
    try:
        return auth.wait_key_in_store(store, timeout_s, who)
    except TimeoutError as e:
        raise LaunchError(str(e)) from None


def address_key(rank: int, restart: int = 0) -> str:
    """Where a rank's worker address is: its first process's, or that of its ``restart``-th
    new process (a replaced rollout instance, single_controller/supervise.py)."""
    return f"{KEY_PREFIX}worker/{rank}" + (f"/restart{restart}" if restart else "")


def publish_address(store: dist.Store, rank: int, address: str, restart: int = 0) -> None:
    store.set(address_key(rank, restart), address)


def wait_addresses(store: dist.Store, world_size: int, timeout_s: float,
                   check: Callable[[], None] | None = None) -> list[str]:
    """Every rank's worker address, in rank order; names the missing ranks on timeout.
    ``check`` is called while waiting and may raise (e.g. when a child process died)."""
    keys = [address_key(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return [store.get(k).decode() for k in keys]
        if time.monotonic() > deadline:
            raise LaunchError(f"worker ranks {missing} did not publish their address within {timeout_s:.0f}s "
                              "(did they start? see their logs)")
        if check is not None:
            check()
        time.sleep(0.05)
