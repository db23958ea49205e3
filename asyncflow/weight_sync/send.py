"""Weight sync, the sending side: every training rank casts and sends its piece of each bucket.

Training rank ``a`` broadcasts its piece of every bucket on its own group (itself and every
remote rollout rank): its own rows of each tensor FSDP2 shards by rows, and the bucket's
other tensors whole where ``a`` is the bucket's source (protocol.py). Split tensors are
never gathered, so the training ranks send at once, each at its own pace. A rank fills its
next piece while the previous ones are on the wire: copies (a cast, small tensors packed) of
at most ``max_inflight`` buckets' worth in flight plus the piece being filled, so the extra
memory of a sender is about two buckets; messages sent from the tensors' own memory cost
none and travel up to ``_MAX_POSTED`` buckets deep. A rollout
instance in the same process (colocated) gets every tensor whole in process (an all-gather
on every training rank), with no copy on the wire.

``send`` returns once no message still on the wire reads the tensors' own memory (with
``wait_direct=False``, at once: the caller then calls ``settle`` before anything writes
them, as the actor does before its optimizer step); what is left on the wire is waited
for at the next ``send`` or ``settle``, so the training rank goes on with its next update
while the receivers take the version in. Copies a slow receiver has not taken yet stay
allocated until then (at most the ``max_inflight`` buckets' worth plus the last piece; what
has arrived is dropped when ``send`` returns). After a failure the sender refuses further
sends: the receivers' groups are out of step with it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from .protocol import Message, WeightHeader, torch_dtype
from .shards import DTensor, local_rows, row_shard_group, whole
from .sinks import WeightSink

# Messages sent from the tensors' own memory hold no extra memory on the wire, so only copies
# count toward ``max_inflight`` (in bytes: that many buckets' worth); this many buckets at most
# are posted at once in all.
_MAX_POSTED = 8


@dataclass
class SendStats:
    bytes_sent: int = 0  # bytes this rank broadcast
    buckets_sent: int = 0
    peak_extra_bytes: int = 0  # the most bytes this rank allocated for sending at once (filled + in flight)
    seconds: float = 0.0
    waits: list[float] = field(default_factory=list)  # time blocked on the wire per bucket


def pack_piece(header: WeightHeader, b: int, named: list[tuple[str, torch.Tensor]], msgs: list[Message],
               sinks: list[WeightSink], gather_all: bool, device: torch.device) -> tuple[list[torch.Tensor], int]:
    """This rank's messages of bucket ``b`` as byte tensors in the header's dtypes, and with
    ``gather_all`` every tensor whole to the local ``sinks``. A direct message is the tensor's
    own memory where its dtype already matches (no copy); small runs are copied into one
    buffer. A tensor that is not split, or every tensor with ``gather_all``, is gathered whole:
    a collective every training rank joins, whether or not its messages hold that tensor.
    Every message is on ``device`` (the wire's). Returns the byte tensors (one per message)
    and how many of their bytes were allocated."""
    where = {sg.index: (m, sg) for m, msg in enumerate(msgs) for sg in msg.segments}
    out: list[torch.Tensor | None] = [None] * len(msgs)
    allocated = 0
    lo, hi = header.buckets[b]
    with torch.no_grad():
        for k in range(lo, hi):
            spec, (name, t) = header.specs[k], named[k]
            m, seg = where.get(k, (None, None))
            dtype = torch_dtype(spec.dtype)
            fresh = 0  # bytes of a tensor made here (gathered or cast) that a direct message keeps alive
            if not gather_all and seg is None and not isinstance(t, DTensor):
                continue  # another rank sends it, and no collective to join
            if gather_all or not spec.split:
                gathered = whole(t)
                full = gathered.to(dtype)
                if full is not gathered or isinstance(t, DTensor):
                    fresh = full.numel() * full.element_size()
                for s in sinks if gather_all else ():
                    s.tensor(spec, full)
                src = full if seg is None or seg.rows is None else full[seg.rows[0]:seg.rows[1]]
            elif seg is not None:
                assert seg.rows is not None  # a split tensor's segment holds rows
                src = local_rows(t, name, seg.rows)
            else:
                continue
            if seg is None:
                continue
            assert m is not None  # found together with seg
            if msgs[m].direct:
                if src.dtype != dtype or not src.is_contiguous() or src.device != device:
                    src, fresh = src.to(device=device, dtype=dtype).contiguous(), seg.nbytes
                out[m] = src.reshape(-1).view(torch.uint8)
                allocated += fresh
                continue
            buf = out[m]
            if buf is None:
                buf = out[m] = torch.empty(msgs[m].nbytes, dtype=torch.uint8, device=device)
                allocated += msgs[m].nbytes
            buf[seg.off:seg.off + seg.nbytes].view(dtype).view(src.shape).copy_(src)
    # Every message has its tensor: each holds at least one segment, and each segment is filled above.
    return cast(list[torch.Tensor], out), allocated


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
        # copy-only messages of the last version still on the wire: (header, pending items)
        self._unsettled: tuple[WeightHeader, deque[Any]] | None = None
        self._failed: str | None = None  # why the last send or settle failed: no further sends

    def _where(self, header: WeightHeader, b: int | None = None) -> str:
        """Where a failure happened: the version, this rank, and bucket ``b`` (-1: the header)."""
        at = "" if b is None else " at its header" if b < 0 else f" at bucket {b + 1}/{len(header.buckets)}"
        return f"weight sync of {header.describe()}: {self.role} rank {self.rank} (source {self.index}){at}"

    def send(self, header: WeightHeader, named: list[tuple[str, torch.Tensor]], wait_direct: bool = True) -> SendStats:
        """Cast and send one version. ``named``: this rank's (name, tensor) in the header's
        order, sharded or not (shards.py). Collective over the training ranks
        where a tensor must be gathered (a local instance, or a tensor not split by rows).
        Returns when every piece of this rank is on its way and, with ``wait_direct``, every
        message that reads the tensors' own memory has been received (see the module's doc)."""
        self.settle()
        if self._failed is not None:
            raise RuntimeError(f"{self._where(header)}: this sender failed before ({self._failed}); its "
                               "weight-sync group is out of step with the receivers")
        stats, start = SendStats(), time.monotonic()
        sinks = list(self.local_sinks() or [])
        b = None
        pending: deque[tuple[int, list[Any], list[Any], int, bool]] = deque()
        try:
            if [n for n, _ in named] != [s.name for s in header.specs]:
                raise RuntimeError("the tensors differ from the header's (every training rank must walk the "
                                   "same model in the same order)")
            if sinks and not self.gather_all:
                raise RuntimeError("a rollout instance shares this rank's process, but the sender was set up "
                                   "with gather_all=False (every training rank must gather every tensor then)")
            self._check_shards(header, named)
            if self.group is not None and self.index == 0:
                works, bufs = self.group.post_object(header)
                pending.append((-1, works, bufs, 0, False))
            for s in sinks:
                s.begin(header)
            held = 0
            # copies on the wire at once: max_inflight buckets' worth, plus the one being filled
            budget = self.max_inflight * max(header.bucket_nbytes(k) for k in range(len(header.buckets)))
            for b in range(len(header.buckets)):
                msgs = header.pieces(b)[self.index] if self.group is not None else []
                bufs, allocated = pack_piece(header, b, named, msgs, sinks, self.gather_all,
                                             self.device(named))  # while earlier ones travel
                if msgs:
                    held += allocated
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, held)
                    packing = b
                    while pending and (len(pending) >= _MAX_POSTED or held > budget):
                        b = pending[0][0]  # an error names the bucket waited for
                        held -= self._wait(pending.popleft(), stats)
                    b = packing
                    # member 0 of its group: this training rank
                    works = [self.group.broadcast(buf, 0) for buf in bufs]
                    # a direct message reads the tensor's own memory: the next update must wait for it
                    pending.append((b, works, bufs, allocated, any(msg.direct for msg in msgs)))
                    stats.bytes_sent += sum(buf.numel() for buf in bufs)
                    stats.buckets_sent += 1
            while pending and (wait_direct and any(item[4] for item in pending)
                               or all(w.is_completed() for w in pending[0][1])):  # arrived: its copies go now
                b = pending[0][0]
                held -= self._wait(pending.popleft(), stats)
            b = None
            for s in sinks:
                s.end(header)
        except BaseException as e:
            for s in sinks:
                s.fail(e)
            self._failed = f"{header.describe()}: {type(e).__name__}: {e}"
            raise RuntimeError(f"{self._where(header, b)} failed: {type(e).__name__}: {e}") from e
        if pending:
            self._unsettled = (header, pending)
        stats.seconds = time.monotonic() - start
        self.last = stats
        return stats

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait until the messages the last ``send`` left on the wire (the header, copies) have
        been received, within ``timeout_s`` in all (default the sender's timeout); a failure
        names that version, this rank and the bucket."""
        if self._unsettled is None:
            return
        header, pending = self._unsettled
        self._unsettled = None
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        b = None
        try:
            while pending:
                b = pending[0][0]
                self._wait(pending.popleft(), SendStats(), max(0.001, deadline - time.monotonic()))
        except BaseException as e:
            self._failed = f"{header.describe()}: {type(e).__name__}: {e}"
            raise RuntimeError(f"{self._where(header, b)} failed: {type(e).__name__}: {e}") from e

    def _check_shards(self, header: WeightHeader, named: list[tuple[str, torch.Tensor]]) -> None:
        """A split tensor's shard i must be on training rank i of this sync (unless every
        tensor is gathered whole, and rows are cut from it)."""
        if self.gather_all:
            return
        for spec, (name, t) in zip(header.specs, named):
            if spec.split:
                at = dist.get_rank(row_shard_group(t))
                if at != self.index:
                    raise RuntimeError(f"{name!r}: this rank holds shard {at} of its rows but is training "
                                       f"index {self.index} of the sync (the FSDP mesh must list the "
                                       "training ranks in the same order)")
                return

    @staticmethod
    def device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
        return named[0][1].device if named else torch.device("cpu")

    def _wait(self, item: tuple[int, list[Any], list[Any], int, bool], stats: SendStats,
              timeout_s: float | None = None) -> int:
        """Wait for every message of a bucket (-1: the header); returns the bytes that frees."""
        b, works, _, allocated, _ = item
        what = "the header" if b < 0 else f"bucket {b + 1}"
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        for work in works:
            try:
                done = work.wait(timedelta(seconds=timeout_s))
            except Exception as e:  # re-raised naming the bucket on the wire
                raise RuntimeError(f"broadcast of {what} failed (timeout {timeout_s:.0f} s): {e}") from e
            if done is False:
                raise TimeoutError(f"{what} was not received within {timeout_s:.0f} s "
                                   "(are the rollout instances alive and receiving?)")
        stats.waits.append(time.monotonic() - t0)
        return allocated
