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
from typing import Any, Iterable, Protocol

import torch

from .weight_sync import TensorSpec, WeightHeader, torch_dtype


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
    """

    def __init__(self, rank: int, index: int, group: Any, local_sinks: Any, timeout_s: float = 300.0,
                 max_inflight: int = 1, role: str = "actor"):
        if max_inflight < 1:
            raise ValueError(f"weight sync: max_inflight must be at least 1, got {max_inflight}")
        self.rank, self.index, self.group = rank, index, group
        self.local_sinks = local_sinks
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.role = role
        self.last = SendStats()

    def _where(self, header: WeightHeader, b: int | None = None) -> str:
        at = f" at bucket {b + 1}/{len(header.buckets)}" if b is not None else ""
        return f"weight sync of {header.describe()}: {self.role} rank {self.rank} (source {self.index}){at}"

    def send(self, header: WeightHeader, tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        """Gather, cast and send one version; ``tensors`` yields (name, full tensor) in the
        header's order (gathering as it goes). Returns when every bucket of this rank is sent."""
        stats, start = SendStats(), time.monotonic()
        sinks = list(self.local_sinks() or [])
        b = None
        try:
            if self.group is not None and self.index == 0:
                self.group.broadcast_object(header, 0)
            for s in sinks:
                s.begin(header)
            it = iter(tensors)
            pending: deque[tuple[int, Any, torch.Tensor]] = deque()
            held = 0
            for b, (lo, hi) in enumerate(header.buckets):
                mine = self.group is not None and header.source(b) == self.index
                if mine:
                    while len(pending) >= self.max_inflight:
                        held -= self._wait(pending.popleft(), stats)
                buf = None
                for spec, off in header.layout(b):
                    name, full = next(it)
                    if name != spec.name:
                        raise RuntimeError(f"tensor order differs from the header: got {name!r}, expected "
                                           f"{spec.name!r} (every training rank must walk the same model)")
                    t = full.to(torch_dtype(spec.dtype))
                    if mine:
                        if buf is None:
                            buf = torch.empty(header.bucket_nbytes(b), dtype=torch.uint8, device=t.device)
                            held += buf.numel()
                            stats.peak_extra_bytes = max(stats.peak_extra_bytes, held)
                        buf[off:off + spec.nbytes].view(t.dtype).view(spec.shape).copy_(t)
                    for s in sinks:
                        s.tensor(spec, t)
                if mine:
                    work = self.group.broadcast(buf, 0)  # member 0 of its group: this training rank
                    pending.append((b, work, buf))
                    stats.bytes_sent += buf.numel()
                    stats.buckets_sent += 1
            while pending:
                b = pending[0][0]
                held -= self._wait(pending.popleft(), stats)
            b = None
            extra = next(it, None)
            if extra is not None:
                raise RuntimeError(f"the model has more tensors than the header lists (first extra: {extra[0]!r})")
            for s in sinks:
                s.end(header)
        except BaseException as e:
            for s in sinks:
                s.fail(e)
            raise RuntimeError(f"{self._where(header, b)} failed: {type(e).__name__}: {e}") from e
        stats.seconds = time.monotonic() - start
        self.last = stats
        return stats

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
