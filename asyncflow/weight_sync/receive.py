"""Weight sync, the receiving side: where a version's tensors go, and the remote receiver.

Two ways to load (``weight_sync.load``):
- ``staged``: the version arrives into a second set of tensors while generation goes on,
  and the rollout service copies it in at a step boundary. Costs one more copy of the
  weights on the rollout device; generation pauses only for the copy, so instances swap in
  turn and are never all paused at once.
- ``in_place``: the tensors go straight into the engine's weights, with generation paused
  for the whole transfer (no second copy: for models that fill the device).

Either way the names, shapes, dtypes and version are checked from the header before any
byte is written, so refused weights leave the engine serving what it had; a transfer that
fails midway leaves a staged engine untouched and an in-place one refusing to generate.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .protocol import TensorSpec, WeightHeader, aligned, torch_dtype, views

LOAD_MODES = ("staged", "in_place")
_AHEAD = 8  # buckets a receiver posts at once where each has its own place (as many as a sender may)

# Rollout instances living in this process (colocated with a training rank): the sender
# hands them every tensor in process. Registered by the rollout worker.
_LOCAL: list[Any] = []
_LOCAL_LOCK = threading.Lock()


def register_local(sink: Any) -> None:
    with _LOCAL_LOCK:
        _LOCAL.append(sink)


def local_sinks() -> list[Any]:
    with _LOCAL_LOCK:
        return list(_LOCAL)


class StagingSink:
    """``staged``: tensors into a second set of buffers; ``take`` gives a whole version or nothing."""

    def __init__(self, check: Callable[[dict, int], None], device: torch.device | str = "cpu"):
        self.check = check  # the engine's check of names, shapes, dtypes and version; raises to refuse
        self.device = torch.device(device)
        self.staging: dict[str, torch.Tensor] = {}  # views into one flat buffer laid out as the buckets
        self._flat = torch.empty(0, dtype=torch.uint8)
        self._starts: list[int] = []  # byte offset of each bucket in the flat buffer
        self._layout: tuple = ()
        self._ready: WeightHeader | None = None
        self._filling: WeightHeader | None = None
        self._lock = threading.Lock()

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

    def fail(self, err: BaseException) -> None:
        with self._lock:
            self._filling = None

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
        self._q: queue.Queue | None = None
        self._fut: Any = None
        self.loaded: WeightHeader | None = None  # the last version loaded whole
        self.result: dict | None = None  # the service's report of that load (version, pause_s)

    def begin(self, header: WeightHeader) -> None:
        self._q = q = queue.Queue(self.depth)
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
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def end(self, header: WeightHeader) -> None:
        self._put(None)
        self.result = self._fut.result(self.timeout_s)
        self.loaded = header

    def fail(self, err: BaseException) -> None:
        if self._q is not None and self._fut is not None and not self._fut.done():
            try:
                self._q.put(err, timeout=1.0)
            except queue.Full:
                pass  # the service times out on the queue and reports it


class BucketReceiver:
    """On a rollout rank with no training rank in its process: receives each version in the
    background, from every training rank's group, into its sink.

    train_ranks: the global ranks of the training ranks (bucket b comes from train_ranks[b % n]).
    groups: training index -> that training rank's weight-sync group (wire_group.WireGroup,
        the training rank is member 0), which this rank has joined.
    """

    def __init__(self, rank: int, role: str, train_ranks: list[int], groups: dict[int, Any], timeout_s: float,
                 device: torch.device | str = "cpu"):
        self.rank, self.role = rank, role
        self.train_ranks = list(train_ranks)
        self.groups = dict(groups)
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.expected_version = -1
        self.header: WeightHeader | None = None  # the last version received whole
        self.bytes_received = 0
        self._scratch: dict = {}  # the streams' scratch, reused by every version (one receive at a time)

    def start(self, version: int, load: Callable[[WeightHeader, Iterator], None],
              dest: Callable[[WeightHeader, int], torch.Tensor] | None = None) -> None:
        """Begin receiving ``version``: ``load(header, tensors)`` consumes the (spec, tensor)
        pairs; ``dest(header, b)``, where given, is the byte buffer bucket b is received into
        (the loader's own memory: no copy). Returns at once. One receive at a time, in order."""
        self.join()
        self.expected_version = int(version)
        self._thread = threading.Thread(target=self._run, args=(load, dest), name=f"weight-recv-v{version}",
                                        daemon=True)
        self._thread.start()

    def _run(self, load: Callable[[WeightHeader, Iterator], None], dest: Any) -> None:
        where = f"weight sync of version {self.expected_version}: {self.role} rank {self.rank}"
        stream: _BucketStream | None = None
        try:
            header: WeightHeader = self.groups[0].broadcast_object(None, 0)
            where = f"weight sync of {header.describe()}: {self.role} rank {self.rank}"
            stream = _BucketStream(header, self.train_ranks, self.groups, self.device, dest, self._scratch)
            try:
                load(header, iter(stream))
            except BaseException:
                stream.drain()  # refused or failed on our side: the senders still finish this version
                raise
            if stream.received != len(header.buckets):
                got = stream.received
                stream.drain()  # the senders still finish this version
                raise RuntimeError(f"the loader stopped after {got} of {len(header.buckets)} buckets")
            self.header = header
            self.bytes_received += stream.bytes
        except BaseException as e:  # noqa: BLE001 - handed to the worker thread by join()
            at = f" at bucket {stream.received + 1}/{len(stream.header.buckets)}" if stream is not None \
                and stream.received < len(stream.header.buckets) else ""
            self._error = RuntimeError(f"{where}{at} failed: {type(e).__name__}: {e}")
            self._error.__cause__ = e

    def join(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(self.timeout_s if timeout is None else timeout)
            if t.is_alive():
                raise TimeoutError(f"weight sync: {self.role} rank {self.rank} did not receive version "
                                   f"{self.expected_version} within {self.timeout_s:.0f} s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    @property
    def pending(self) -> bool:
        return self._thread is not None


@dataclass
class PostedBucket:
    """Bucket ``b``'s receives, posted: each training rank's piece on its own group at once."""
    b: int
    full: torch.Tensor  # the bucket's byte buffer, as ``protocol.views`` reads it
    posted: list  # (training index, message, buffer, work)


def post_bucket(header: WeightHeader, b: int, groups: Any, full: torch.Tensor,
                scratch: Callable[[int, int], torch.Tensor]) -> PostedBucket:
    """Post the receives of bucket ``b`` into ``full``: a direct message lands in place, a
    packed one into ``scratch(i, nbytes)`` (copied to where its rows go by ``finish_bucket``).
    Every training rank's messages are posted at once, each rank's on its own group."""
    pieces = header.pieces(b)
    missing = [i for i, msgs in enumerate(pieces) if msgs and i not in groups]
    if missing:  # before anything is posted: no group is left a receive ahead of its sender
        raise RuntimeError(f"bucket {b + 1} has messages from training index {missing[0]}, but this rank joined "
                           f"the groups of {sorted(groups)} only")
    posted = []
    for i, msgs in enumerate(pieces):
        for msg in msgs:
            first = msg.segments[0]
            buf = full[first.at:first.at + msg.nbytes] if msg.direct else scratch(i, msg.nbytes)
            posted.append((i, msg, buf, groups[i].broadcast(buf, 0)))
    return PostedBucket(b, full, posted)


def finish_bucket(p: PostedBucket, groups: Any, train_ranks: list[int] | None = None) -> int:
    """Wait for every piece of a posted bucket and put each in place; returns the bytes received.
    Every receive is awaited even after one failed, so that none is left on the wire to take a
    later message for its own; then the first failure is raised."""
    error = None
    for i, msg, buf, work in p.posted:
        who = f"training rank {train_ranks[i]}" if train_ranks else f"training index {i}"
        try:
            groups[i].wait(work, f"bucket {p.b + 1} from {who}")
        except Exception as e:  # noqa: BLE001 - raised once all are settled
            error = error or e
            continue
        if not msg.direct:
            for sg in msg.segments:
                p.full[sg.at:sg.at + sg.nbytes].copy_(buf[sg.off:sg.off + sg.nbytes])
    if error is not None:
        raise error
    return sum(x[2].numel() for x in p.posted)


class _BucketStream:
    """The (spec, tensor) pairs of a version as its buckets arrive: each bucket into the
    loader's own bytes (``dest``) where it has them, else into scratch. The next bucket's
    receives are posted before this one is put in place and handed out, so the wire never
    waits for the loader."""

    def __init__(self, header: WeightHeader, train_ranks: list[int], groups: dict[int, Any], device: torch.device,
                 dest: Any = None, scratch: dict | None = None):
        if header.n_sources != len(train_ranks):
            raise RuntimeError(f"the version comes from {header.n_sources} training ranks, but "
                               f"{len(train_ranks)} take part in this sync")
        self.header = header
        self.train_ranks, self.groups = train_ranks, groups
        self.dest, self.device = dest, device
        self.scratch: dict[tuple, torch.Tensor] = {} if scratch is None else scratch  # (what, slot) -> buffer
        self.draining = False  # refused or failed: the rest goes to scratch, never to the loader
        self.broken = False  # a receive failed: the groups are out of step, nothing more is read
        self.ahead: deque[PostedBucket] = deque()  # posted, not yet finished, in order
        self.received = 0
        self.bytes = 0

    def _scratch(self, what: Any, slot: int, n: int, size: Callable[[], int]) -> torch.Tensor:
        buf = self.scratch.get((what, slot))
        if buf is None or buf.numel() < n:
            buf = self.scratch[(what, slot)] = torch.empty(size(), dtype=torch.uint8, device=self.device)
        return buf[:n]

    @property
    def depth(self) -> int:
        """Buckets posted at once: into the loader's own bytes every bucket has its place, so
        several can be on the wire; into scratch, two (a bucket of scratch each)."""
        return _AHEAD if self.dest is not None and not self.draining else 2

    def _post(self, b: int) -> PostedBucket:
        h, slot = self.header, b % (_AHEAD + 1)
        n = h.bucket_nbytes(b)
        if self.dest is not None and not self.draining:
            full = self.dest(h, b)
        else:
            full = self._scratch("bucket", b % 2, n, lambda: max(h.bucket_nbytes(k) for k in range(len(h.buckets))))
        return post_bucket(h, b, self.groups, full, lambda i, m: self._scratch(i, slot, m, lambda: m))

    def _next(self) -> torch.Tensor:
        """Finish bucket ``received`` (posted earlier where it was) once the ones after it are
        posted, up to ``depth`` in all."""
        nb = len(self.header.buckets)
        try:
            if not self.ahead:
                self.ahead.append(self._post(self.received))
            while len(self.ahead) < self.depth and self.ahead[-1].b + 1 < nb:
                self.ahead.append(self._post(self.ahead[-1].b + 1))
            cur = self.ahead.popleft()
            self.bytes += finish_bucket(cur, self.groups, self.train_ranks)
        except BaseException:
            self.broken = True
            raise
        self.received += 1
        return cur.full

    def __iter__(self) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        while self.received < len(self.header.buckets):
            b = self.received
            yield from views(self.header, b, self._next())

    def drain(self) -> None:
        """Read the rest off the wire into scratch memory (never into the loader's; a bucket
        already posted lands where it was posted); nothing after a failed receive (the run
        stops: its senders are gone or out of step)."""
        self.draining = True
        while not self.broken and self.received < len(self.header.buckets):
            self._next()
