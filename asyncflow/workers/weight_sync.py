"""Weight sync: the actor's full weights, from host memory, to every rollout instance.

The actor's first rank packs its full state dict into one flat host buffer per dtype
and sends it in the background, one thread per rollout instance, over a
torch.distributed group made of that rank and the instance's ranks (gloo for host
memory). Each rollout rank receives in a background thread of its own into fresh
buffers (staging), and the rollout worker swaps them in between generations. A
rollout instance on the actor's own rank gets the packed weights in process.

Wire protocol per sync, on the instance's group: one ``broadcast_object_list`` with the
header (version, names, shapes, dtypes), then one ``broadcast`` per dtype buffer.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WeightHeader:
    version: int  # the policy version (0 for warm-up weights too)
    seq: int  # publish counter: strictly increasing, tells a newer publish of the same version apart
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # one per name, e.g. "float32"

    def buffer_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for shape, dt in zip(self.shapes, self.dtypes):
            sizes[dt] = sizes.get(dt, 0) + _numel(shape)
        return sizes

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(dt).itemsize for dt, n in self.buffer_sizes().items())


@dataclass
class PackedWeights:
    header: WeightHeader
    buffers: dict[str, torch.Tensor]  # dtype name -> flat host tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Views into the flat buffers, under the original names."""
        out, pos = {}, {dt: 0 for dt in self.buffers}
        for name, shape, dt in zip(self.header.names, self.header.shapes, self.header.dtypes):
            n = _numel(shape)
            out[name] = self.buffers[dt][pos[dt]:pos[dt] + n].view(shape)
            pos[dt] += n
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return dt


def pack_weights(state_dict: Mapping[str, torch.Tensor], version: int, seq: int = 0) -> PackedWeights:
    """Copy a state dict into one contiguous host buffer per dtype (one send each)."""
    names, shapes, dtypes = [], [], []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        names.append(name)
        shapes.append(tuple(t.shape))
        dtypes.append(str(t.dtype).removeprefix("torch."))
    header = WeightHeader(int(version), int(seq), tuple(names), tuple(shapes), tuple(dtypes))
    buffers = {dt: torch.empty(n, dtype=_dtype(dt)) for dt, n in header.buffer_sizes().items()}
    pos = {dt: 0 for dt in buffers}
    for name, dt in zip(names, dtypes):
        t = state_dict[name].detach()
        n = t.numel()
        buffers[dt][pos[dt]:pos[dt] + n].copy_(t.reshape(-1))
        pos[dt] += n
    return PackedWeights(header, buffers)


class _Mailbox:
    """The newest packed weights of this process, for a rollout instance on the actor's rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packed: PackedWeights | None = None

    def put(self, packed: PackedWeights) -> None:
        with self._lock:
            self._packed = packed

    def get(self) -> PackedWeights | None:
        with self._lock:
            return self._packed


LOCAL_MAILBOX = _Mailbox()


class _Send(threading.Thread):
    """One background send; a daemon, so a peer that never receives cannot keep the process alive."""

    def __init__(self, group: Any, src: int, packed: PackedWeights, inst: int):
        super().__init__(name=f"weight-send-i{inst}-v{packed.header.version}", daemon=True)
        self.group, self.src, self.packed = group, src, packed
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            dist.broadcast_object_list([self.packed.header], src=self.src, group=self.group)
            for dt in sorted(self.packed.buffers):
                dist.broadcast(self.packed.buffers[dt], src=self.src, group=self.group)
        except BaseException as e:  # noqa: BLE001 - raised in the worker thread by wait()
            self.error = e


class WeightSender:
    """On the actor's first rank: sends each published version to every instance in the background."""

    def __init__(self, src_rank: int, groups: Mapping[int, Any], timeout_s: float = 300.0):
        self.src_rank = src_rank
        self.groups = dict(groups)  # instance index -> process group (None: the instance is this process)
        self.timeout_s = timeout_s
        self._inflight: dict[int, _Send] = {}
        self.sent_bytes = 0

    def publish(self, packed: PackedWeights) -> None:
        """Start sending ``packed`` to every instance (after the previous send to it finished)."""
        for inst, group in self.groups.items():
            prev = self._inflight.pop(inst, None)
            if prev is not None:
                self._finish(inst, prev)
            if group is not None:
                send = _Send(group, self.src_rank, packed, inst)
                send.start()
                self._inflight[inst] = send

    def _finish(self, inst: int, send: _Send) -> None:
        send.join(self.timeout_s)
        if send.is_alive():
            raise TimeoutError(f"weight sync: sending version {send.packed.header.version} to rollout instance "
                               f"{inst} did not finish within {self.timeout_s:.0f} s (is it alive and receiving?)")
        if send.error is not None:
            raise RuntimeError(f"weight sync: sending version {send.packed.header.version} to rollout instance "
                               f"{inst} failed: {send.error}") from send.error
        self.sent_bytes += send.packed.header.nbytes

    def wait(self) -> None:
        for inst, send in list(self._inflight.items()):
            self._finish(inst, send)
        self._inflight.clear()


class WeightReceiver:
    """On each rollout rank: receives a version in the background; the worker takes it when it can."""

    def __init__(self, src_rank: int, group: Any, timeout_s: float = 300.0):
        self.src_rank = src_rank
        self.group = group
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._staged: PackedWeights | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.expected_version = -1

    def start(self, version: int) -> None:
        """Begin receiving ``version`` (the sender publishes it); returns at once."""
        self.join()  # one receive at a time on this group, in version order
        self.expected_version = int(version)
        self._thread = threading.Thread(target=self._recv, name=f"weight-recv-v{version}", daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        try:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.src_rank, group=self.group)
            header: WeightHeader = box[0]
            buffers = {dt: torch.empty(n, dtype=_dtype(dt)) for dt, n in header.buffer_sizes().items()}
            for dt in sorted(buffers):
                dist.broadcast(buffers[dt], src=self.src_rank, group=self.group)
            with self._lock:
                self._staged = PackedWeights(header, buffers)
        except BaseException as e:  # noqa: BLE001 - handed to the worker thread by take()/join()
            self._error = e

    def join(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(self.timeout_s if timeout is None else timeout)
            if t.is_alive():
                raise TimeoutError(f"weight sync: receiving version {self.expected_version} from rank "
                                   f"{self.src_rank} did not finish within {self.timeout_s:.0f} s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"weight sync: receiving version {self.expected_version} from rank "
                               f"{self.src_rank} failed: {err}") from err

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def ready(self) -> bool:
        """A staged version waits to be swapped in."""
        with self._lock:
            return self._staged is not None

    def take(self) -> PackedWeights | None:
        with self._lock:
            staged, self._staged = self._staged, None
        return staged
