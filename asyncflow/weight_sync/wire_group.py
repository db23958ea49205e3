"""A process group of its own for weight sync, found through a TCP store.

The launcher's world holds only the ranks it started; vLLM's model workers are processes
of vLLM's own. A weight-sync group is therefore made outside that world: its first member
(a training rank) hosts a TCP store, and every member, a rollout rank or a vLLM worker
alike, joins with its index in the group. Backend from the platform: gloo on CPU, nccl on
CUDA, hccl on Ascend (torch_npu).
"""
from __future__ import annotations

import os
import pickle
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WireAddress:
    host: str
    port: int
    size: int  # members: the training rank (index 0) and every receiving endpoint
    backend: str  # gloo | nccl | hccl
    name: str  # unique per group (a prefix in the store)

    def to_dict(self) -> dict:  # what crosses a worker call (JSON values only)
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, d: "WireAddress | dict") -> "WireAddress":
        return d if isinstance(d, WireAddress) else cls(**d)


def _host() -> str:
    """The interface of this host that routes to the run's master (loopback for a local run),
    as the launcher binds its own sockets."""
    from ..single_controller.rendezvous import rendezvous_host
    return rendezvous_host(os.environ.get("MASTER_ADDR", "127.0.0.1"))


def open_store(size: int, backend: str, name: str, timeout_s: float, host: str | None = None) -> tuple[Any, WireAddress]:
    """On the first member: start the group's store on a free port; give its address to the others."""
    if size < 2:
        raise ValueError(f"weight-sync group {name!r}: needs at least 2 members, got {size}")
    host = host or _host()
    store = dist.TCPStore(host, 0, world_size=size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, WireAddress(host, int(store.port), int(size), backend, name)


def _process_group(backend: str, store: Any, index: int, size: int, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, index, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, index, size, opts)
    if backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # lazily: Ascend only
        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, index, size, opts)
    raise ValueError(f"weight-sync group: unknown backend {backend!r} (gloo | nccl | hccl)")


class WireGroup:
    """One member of a weight-sync group. Joining blocks until every member has joined."""

    def __init__(self, addr: WireAddress | dict, index: int, timeout_s: float = 300.0,
                 device: torch.device | str = "cpu", store: Any = None):
        addr = WireAddress.of(addr)
        if not 0 <= index < addr.size:
            raise ValueError(f"weight-sync group {addr.name!r}: member index {index} outside 0..{addr.size - 1}")
        self.addr, self.index, self.timeout_s = addr, int(index), float(timeout_s)
        self.device = torch.device(device)
        if store is None:
            store = dist.TCPStore(addr.host, addr.port, world_size=addr.size, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
        self._store = store  # the first member's store serves the others: keep it alive
        self.pg = _process_group(addr.backend, dist.PrefixStore(f"asyncflow/ws/{addr.name}", store), self.index,
                                 addr.size, timeout_s)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> Any:
        """Post a broadcast of ``t`` from member ``src``; returns the Work (``wait()`` it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(src), 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([t], opts)

    def post_object(self, obj: Any) -> tuple[list, list[torch.Tensor]]:
        """The source's side of ``broadcast_object`` (this member the source) without waiting:
        the posted works and the buffers they read (keep both until the works are done)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        return [self.broadcast(size, self.index), self.broadcast(data, self.index)], [size, data]

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` from member ``src`` to every member (the others pass None)."""
        if self.index == src:
            works, _ = self.post_object(obj)
            for work, what in zip(works, ("the header's size", "the header")):
                self.wait(work, what)
            return obj
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.wait(self.broadcast(size, src), "the header's size")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.broadcast(data, src), "the header")
        return pickle.loads(data.cpu().numpy().tobytes())

    def wait(self, work: Any, what: str) -> None:
        """Wait for a posted broadcast; a failure or timeout names the group and ``what``."""
        try:
            done = work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - re-raised with what was awaited
            raise RuntimeError(f"weight-sync group {self.addr.name!r} (member {self.index}): {what} failed "
                               f"(timeout {self.timeout_s:.0f} s): {e}") from e
        if done is False:
            raise TimeoutError(f"weight-sync group {self.addr.name!r}: {what} did not arrive within "
                               f"{self.timeout_s:.0f} s")

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if shutdown is not None:
            shutdown()
