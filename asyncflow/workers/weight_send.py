"""Weight sync, the sending side: every training rank gathers, casts and sends its share.

All training ranks walk the model's tensors together (gathering a sharded parameter is a
collective over their group). Training rank ``a`` broadcasts buckets ``a, a + n, ...`` on
its own group (itself and every remote rollout rank) and fills the next of its buckets
while the previous one is on the wire: at most ``max_inflight`` buckets of its own in flight
plus the one being filled, so the extra memory of a sender is about two buckets. A rollout
instance in the same process (colocated) gets every tensor handed over in process, with
no copy on the wire.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from ..engines.train.gather import full_tensors, gather_bucket
from .weight_sync import TensorSpec, WeightHeader, torch_dtype, views


class WeightSink(Protocol):
    """Where the tensors of a version go on the receiving side (weight_recv.py)."""

    def begin(self, header: WeightHeader) -> None: ...
    def tensor(self, spec: TensorSpec, t: torch.Tensor) -> None: ...
    def end(self, header: WeightHeader) -> None: ...
    def fail(self, err: BaseException) -> None: ...


@dataclass
class SendStats:
    bytes_sent: int = 0  # bytes this rank broadcast
    buckets_sent: int = 0
    peak_extra_bytes: int = 0  # the most bucket bytes this rank held at once (filled + in flight)
    seconds: float = 0.0
    waits: list[float] = field(default_factory=list)  # time blocked on the wire per bucket


class BucketSender:
    """One training rank's part of every sync.

    index: this rank's position among the training ranks of the sync (0 sends the header).
    group: its own weight-sync group (wire_group.WireGroup, this rank member 0) with every
        remote receiving endpoint, or None when there is none.
    local_sinks: returns the sinks of rollout instances in this process (may be empty).
    train_ranks: the global ranks of all training ranks, in index order.
    """

    def __init__(self, rank: int, index: int, group: Any, local_sinks: Any, timeout_s: float = 300.0,
                 max_inflight: int = 1, role: str = "actor", train_ranks: list[int] | None = None,
                 gather_all: bool = True):
        if max_inflight < 1:
            raise ValueError(f"weight sync: max_inflight must be at least 1, got {max_inflight}")
        self.rank, self.index, self.group = rank, index, group
        self.train_ranks = list(train_ranks) if train_ranks is not None else [rank]
        # True: every rank gets each tensor whole (an instance is in some training rank's
        # process); False: each bucket is gathered into its sender only. The same on every rank.
        self.gather_all = gather_all
        self.local_sinks = local_sinks
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.role = role
        self.last = SendStats()

    def _where(self, header: WeightHeader, b: int | None = None) -> str:
        at = f" at bucket {b + 1}/{len(header.buckets)}" if b is not None else ""
        return f"weight sync of {header.describe()}: {self.role} rank {self.rank} (source {self.index}){at}"

    def send(self, header: WeightHeader, named: list[tuple[str, torch.Tensor]]) -> SendStats:
        """Gather, cast and send one version. ``named``: this rank's (name, tensor) in the
        header's order, sharded or not (engines/train/gather.py). Collective over the training
        ranks. Returns when every bucket of this rank is on its way and received."""
        stats, start = SendStats(), time.monotonic()
        sinks = list(self.local_sinks() or [])
        b = None
        try:
            if [n for n, _ in named] != [s.name for s in header.specs]:
                raise RuntimeError("the tensors differ from the header's (every training rank must walk the "
                                   "same model in the same order)")
            if self.group is not None and self.index == 0:
                self.group.broadcast_object(header, 0)
            for s in sinks:
                s.begin(header)
            it = full_tensors(named) if self.gather_all else None
            pending: deque[tuple[int, Any, torch.Tensor]] = deque()
            held = 0
            for b, (lo, hi) in enumerate(header.buckets):
                mine = self.group is not None and header.source(b) == self.index
                if mine:
                    while len(pending) >= self.max_inflight:
                        held -= self._wait(pending.popleft(), stats)
                    buf = torch.empty(header.bucket_nbytes(b), dtype=torch.uint8, device=self.device(named))
                    held += buf.numel()
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, held)
                if it is not None:  # every rank gets each tensor whole (an instance in its process)
                    for spec, off in header.layout(b):
                        _, full = next(it)
                        t = full.to(torch_dtype(spec.dtype))
                        if mine:
                            buf[off:off + spec.nbytes].view(t.dtype).view(spec.shape).copy_(t)
                        for s in sinks:
                            s.tensor(spec, t)
                elif self.group is not None:  # only the bucket's sender gets it, into the buffer
                    dests = [v for _, v in views(header, b, buf)] if mine else None
                    gather_bucket(named[lo:hi], [torch_dtype(sp.dtype) for sp in header.specs[lo:hi]], dests,
                                  self.train_ranks[header.source(b)])
                if mine:
                    work = self.group.broadcast(buf, 0)  # member 0 of its group: this training rank
                    pending.append((b, work, buf))
                    stats.bytes_sent += buf.numel()
                    stats.buckets_sent += 1
            while pending:
                b = pending[0][0]
                held -= self._wait(pending.popleft(), stats)
            b = None
            for s in sinks:
                s.end(header)
        except BaseException as e:
            for s in sinks:
                s.fail(e)
            raise RuntimeError(f"{self._where(header, b)} failed: {type(e).__name__}: {e}") from e
        stats.seconds = time.monotonic() - start
        self.last = stats
        return stats

    @staticmethod
    def device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
        return named[0][1].device if named else torch.device("cpu")

    def _wait(self, item: tuple[int, Any, torch.Tensor], stats: SendStats) -> int:
        b, work, buf = item
        t0 = time.monotonic()
        try:
            done = work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - re-raised naming the bucket on the wire
            raise RuntimeError(f"broadcast of bucket {b + 1} failed: {e}") from e
        if done is False:
            raise TimeoutError(f"bucket {b + 1} was not received within {self.timeout_s:.0f} s "
                               "(are the rollout instances alive and receiving?)")
        stats.waits.append(time.monotonic() - t0)
        return buf.numel()
