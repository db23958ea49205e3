"""Weight sync, where a version's tensors go on the rollout side (a ``WeightSink``).

Two ways to load (``weight_sync.load``):
- ``staged`` (``StagingSink``): the version arrives into a second set of tensors while
  generation goes on, and the rollout service copies it in at a step boundary. Costs one
  more copy of the weights on the rollout device; generation pauses only for the copy, so
  instances swap in turn and are never all paused at once.
- ``in_place`` (``InPlaceSink``): the tensors go straight into the engine's weights, with
  generation paused for the whole transfer (no second copy: for models that fill the device).

Either way the names, shapes, dtypes and version are checked from the header before any
byte is written, so refused weights leave the engine serving what it had; a transfer that
fails midway leaves a staged engine untouched and an in-place one refusing to generate.

A sink is fed by the sender itself for an instance in a training rank's process (registered
with ``register_local``), else by the instance's ``receive.BucketReceiver``.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .protocol import TensorSpec, WeightHeader, aligned, views

LOAD_MODES = ("staged", "in_place")

# Rollout instances living in this process (colocated with a training rank): the sender
# hands them every tensor in process. Registered by the instance's intake (intake.py).
_LOCAL: list[Any] = []
_LOCAL_LOCK = threading.Lock()


def register_local(sink: Any) -> None:
    with _LOCAL_LOCK:
        _LOCAL.append(sink)


def local_sinks() -> list[Any]:
    with _LOCAL_LOCK:
        return list(_LOCAL)


class WeightSink(Protocol):
    """Where the tensors of a version go: ``begin`` (refuses a version by raising), every
    tensor in the header's order, then ``end``; ``fail`` instead when the transfer broke."""

    def begin(self, header: WeightHeader) -> None: ...
    def tensor(self, spec: TensorSpec, t: torch.Tensor) -> None: ...
    def end(self, header: WeightHeader) -> None: ...
    def fail(self, err: BaseException) -> None: ...


class StagingSink:
    """``staged``: tensors into a second set of buffers; ``take`` gives a whole version or nothing."""

    def __init__(self, check: Callable[[dict[str, torch.Tensor], int], None], device: torch.device | str = "cpu"):
        self.check = check  # the engine's check of names, shapes, dtypes and version; raises to refuse
        self.device = torch.device(device)
        self.staging: dict[str, torch.Tensor] = {}  # views into one flat buffer laid out as the buckets
        self._flat = torch.empty(0, dtype=torch.uint8)
        self._starts: list[int] = []  # byte offset of each bucket in the flat buffer
        self._layout: tuple[Any, ...] = ()
        self._ready: WeightHeader | None = None
        self._filling: WeightHeader | None = None
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # end(): a whole version is ready

    def begin(self, header: WeightHeader) -> None:
        self.check({s.name: s.meta() for s in header.specs}, header.version)
        with self._lock:
            self._ready = None  # being overwritten: not a whole version until end()
            self._filling = header
        if self._layout != (header.specs, header.buckets):  # allocated once, reused by every version
            sizes = [aligned(header.bucket_nbytes(b)) for b in range(len(header.buckets))]  # every bucket 8-aligned
            self._starts = [sum(sizes[:b]) for b in range(len(sizes))]
            self._flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self.staging = {spec.name: t for b in range(len(sizes))
                            for spec, t in views(header, b, self.bucket_buffer(header, b))}
            self._layout = (header.specs, header.buckets)

    def bucket_buffer(self, header: WeightHeader, b: int) -> torch.Tensor:
        """Where bucket ``b`` lands: the staging tensors' own bytes (received with no copy)."""
        start = self._starts[b]
        return self._flat[start:start + header.bucket_nbytes(b)]

    def tensor(self, spec: TensorSpec, t: torch.Tensor) -> None:
        held = self.staging[spec.name]
        if t.data_ptr() != held.data_ptr():  # received into the staging bytes already: nothing to copy
            held.copy_(t)

    def end(self, header: WeightHeader) -> None:
        with self._lock:
            self._ready, self._filling = header, None
            self._landed.notify_all()

    def fail(self, err: BaseException) -> None:
        with self._lock:
            self._filling = None

    def wait_newer(self, held: int, timeout_s: float) -> bool:
        """Wait until a whole version newer than publish counter ``held`` is staged (the sender
        in this process is feeding it); False after ``timeout_s``."""
        with self._landed:
            return self._landed.wait_for(lambda: self._ready is not None and self._ready.seq > held, timeout_s)

    def take(self) -> tuple[WeightHeader, dict[str, torch.Tensor]] | None:
        with self._lock:
            ready, self._ready = self._ready, None
        return None if ready is None else (ready, self.staging)


class InPlaceSink:
    """``in_place`` for an instance in the sender's process: the tensors go through a short
    queue into the service, which loads them into the engine's weights while paused."""

    def __init__(self, service: Any, timeout_s: float, depth: int = 4):
        self.service = service
        self.timeout_s = timeout_s
        self.depth = depth
        self._q: queue.Queue[Any] | None = None
        self._fut: Any = None
        self.loaded: WeightHeader | None = None  # the last version loaded whole
        self.result: dict[str, Any] | None = None  # the service's report of that load (version, pause_s)
        self._landed = threading.Condition()  # end(): a version is loaded whole

    def begin(self, header: WeightHeader) -> None:
        self._q = q = queue.Queue[Any](self.depth)
        self.loaded = None

        def stream() -> Iterator[tuple[TensorSpec, torch.Tensor]]:
            while True:
                item = q.get(timeout=self.timeout_s)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the sender failed: {item}") from item
                yield item
        self._fut = self.service.update_weights_stream(header.specs, stream(), header.version)

    def tensor(self, spec: TensorSpec, t: torch.Tensor) -> None:
        self._put((spec, t))

    def _put(self, item: Any) -> None:
        while True:  # the service may refuse the version before reading: then stop feeding it
            if self._fut.done():
                self._fut.result(0)  # raises the refusal
                raise RuntimeError("the service finished the load before the stream ended")
            assert self._q is not None  # set by begin(), before any tensor is put
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def end(self, header: WeightHeader) -> None:
        self._put(None)
        result = self._fut.result(self.timeout_s)
        with self._landed:
            self.result, self.loaded = result, header
            self._landed.notify_all()

    def wait_newer(self, held: int, timeout_s: float) -> bool:
        """Wait until a version newer than publish counter ``held`` is loaded whole; False after
        ``timeout_s``."""
        with self._landed:
            return self._landed.wait_for(lambda: self.loaded is not None and self.loaded.seq > held, timeout_s)

    def fail(self, err: BaseException) -> None:
        if self._q is not None and self._fut is not None and not self._fut.done():
            try:
                self._q.put(err, timeout=1.0)
            except queue.Full:
                pass  # the service times out on the queue and reports it
