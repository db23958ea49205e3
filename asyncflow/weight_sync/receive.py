"""Weight sync, the receiving side over the wire: a rollout rank with no training rank in its
process receives each version from every training rank's group, bucket after bucket, and
hands its tensors to a loader (``sinks.py``: into a staged copy, or into the engine's
weights). vLLM's workers receive with the same ``post_bucket`` / ``finish_bucket``
(engines/rollout/vllm_worker.py).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .protocol import TensorSpec, WeightHeader, views

_AHEAD = 8  # buckets a receiver posts at once where each has its own place (as many as a sender may)


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
        # the streams' scratch, reused by every version (one receive at a time)
        self._scratch: dict[tuple[Any, ...], torch.Tensor] = {}

    def start(self, version: int, load: Callable[[WeightHeader, Iterator[Any]], None],
              dest: Callable[[WeightHeader, int], torch.Tensor] | None = None) -> None:
        """Begin receiving ``version``: ``load(header, tensors)`` consumes the (spec, tensor)
        pairs; ``dest(header, b)``, where given, is the byte buffer bucket b is received into
        (the loader's own memory: no copy). Returns at once. One receive at a time, in order."""
        self.join()
        self.expected_version = int(version)
        self._thread = threading.Thread(target=self._run, args=(load, dest), name=f"weight-recv-v{version}",
                                        daemon=True)
        self._thread.start()

    def _run(self, load: Callable[[WeightHeader, Iterator[Any]], None], dest: Any) -> None:
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
    posted: list[Any]  # (training index, message, buffer, work)


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
                 dest: Any = None, scratch: dict[tuple[Any, ...], torch.Tensor] | None = None):
        if header.n_sources != len(train_ranks):
            raise RuntimeError(f"the version comes from {header.n_sources} training ranks, but "
                               f"{len(train_ranks)} take part in this sync")
        self.header = header
        self.train_ranks, self.groups = train_ranks, groups
        self.dest, self.device = dest, device
        self.scratch: dict[tuple[Any, ...], torch.Tensor] = {} if scratch is None else scratch  # (what, slot) -> buffer
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
