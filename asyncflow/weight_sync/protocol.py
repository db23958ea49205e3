"""Weight sync, the protocol: what a version is on the wire and how it is cut into buckets.

A version goes from the training ranks to the rollout instances as a header, then buckets.
The header lists every tensor (name, shape, dtype after the cast to the rollout dtype) and
cuts the list into buckets of about ``bucket_bytes``, in the model's state-dict order, so
that the senders walk parameters layer after layer. On the receiving side a bucket is one
flat byte buffer in which each tensor starts at an 8-byte-aligned offset.

On the wire a bucket is a piece per training rank (``pieces``): a tensor whose rows the
training ranks hold as FSDP2's dim-0 shards (``TensorSpec.split``) is sent by every rank as
its own rows, so nothing crosses between training ranks; any other tensor goes whole from
rank ``b % n_sources``. Each rank broadcasts its piece on its own group, all at once, and
the receivers put the rows where the whole tensor has them.

Sending: ``send.py``; receiving: ``receive.py``; where the tensors go: ``sinks.py``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .shards import chunk_rows, row_shard_group

_ALIGN = 8  # the widest element size: every tensor view into a bucket is aligned


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    split: bool = False  # rows split over the training ranks as torch.chunk splits them (FSDP2's shards)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize

    def meta(self) -> torch.Tensor:
        """A tensor of this shape and dtype that holds no memory (for checks before the data)."""
        return torch.empty(self.shape, dtype=torch_dtype(self.dtype), device="meta")


# A run of at least this many bytes travels as a message of its own: sent from the tensor's own
# memory and received where it belongs, with no copy on either side. Smaller runs are packed
# together: a message costs its sender and each receiver a fixed share of CPU (the backend's
# threads woken, its bookkeeping), more than copying a run this small does, so a model's small
# tensors (norms, biases; every tensor of a small model) share one message.
DIRECT_BYTES = 1 << 19


@dataclass(frozen=True)
class Segment:
    """A run of one tensor's bytes in a message."""
    index: int  # the tensor's index in the header's specs
    rows: tuple[int, int] | None  # [lo, hi) of a split tensor; None: the whole tensor
    at: int  # byte offset in the bucket's buffer (the whole tensor's layout)
    off: int  # byte offset in the message
    nbytes: int


@dataclass(frozen=True)
class Message:
    """One broadcast of a training rank: a single run (``direct``) or small runs packed."""
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.segments[-1].off + self.segments[-1].nbytes

    @property
    def direct(self) -> bool:
        return len(self.segments) == 1


def _messages(runs: list[tuple[int, tuple[int, int] | None, int, int]]) -> list[Message]:
    out: list[Message] = []
    packed: list[Segment] = []
    off = 0
    for k, rows, at, n in runs:
        if n >= DIRECT_BYTES:
            out.append(Message((Segment(k, rows, at, 0, n),)))
            continue
        packed.append(Segment(k, rows, at, off, n))
        off = aligned(off + n)
    if packed:
        out.append(Message(tuple(packed)))
    return out


@dataclass(frozen=True)
class WeightHeader:
    version: int  # the policy version (0 for warm-up weights too)
    seq: int  # publish counter: strictly increasing, tells a newer publish of the same version apart
    specs: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, int], ...]  # [start, end) indices into specs, in sending order
    n_sources: int  # bucket b comes from training rank b % n_sources of the sync

    def source(self, b: int) -> int:
        return b % self.n_sources

    def layout(self, b: int) -> list[tuple[TensorSpec, int]]:
        """The tensors of bucket ``b`` with their byte offsets in its buffer."""
        out, off = [], 0
        start, end = self.buckets[b]
        for spec in self.specs[start:end]:
            out.append((spec, off))
            off = aligned(off + spec.nbytes)
        return out

    def pieces(self, b: int) -> list[list[Message]]:
        """What each training rank sends of bucket ``b``, as its messages: its rows of every split
        tensor, and every other tensor whole from the bucket's source. A rank with nothing in
        the bucket sends nothing."""
        runs: list[list[Any]] = [[] for _ in range(self.n_sources)]
        start = self.buckets[b][0]
        for k, (spec, at) in enumerate(self.layout(b), start):
            parts = [(i, chunk_rows(spec.shape[0], self.n_sources, i)) for i in range(self.n_sources)] \
                if spec.split else [(self.source(b), None)]
            row = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
            for i, rows in parts:
                n = spec.nbytes if rows is None else (rows[1] - rows[0]) * row
                if n:
                    runs[i].append((k, rows, at + (0 if rows is None else rows[0] * row), n))
        return [_messages(r) for r in runs]

    def bucket_nbytes(self, b: int) -> int:
        lay = self.layout(b)
        spec, off = lay[-1]
        return off + spec.nbytes

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def describe(self) -> str:
        return (f"version {self.version} ({len(self.specs)} tensors, {len(self.buckets)} buckets, "
                f"{self.nbytes / 2**20:.1f} MiB)")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """Consecutive runs of ``specs`` of at most ``bucket_bytes`` each (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight sync: bucket size must be positive, got {bucket_bytes} bytes "
                         "(set weight_sync.bucket_mb)")
    out, start, size, n = [], 0, 0, 0
    for i, spec in enumerate(specs):
        need = aligned(spec.nbytes)
        if i > start and size + need > bucket_bytes:
            out.append((start, i))
            start, size = i, 0
        size += need
        n = i + 1
    if n > start:
        out.append((start, n))
    return tuple(out)


def make_header(tensors: Iterable[tuple[str, torch.Tensor]], version: int, seq: int, bucket_bytes: int,
                n_sources: int, cast: torch.dtype | None) -> WeightHeader:
    """The header of a version from the (possibly sharded) tensors' global shapes: floating
    tensors are announced in ``cast`` (the rollout dtype), others as they are; a tensor whose
    rows are sharded over exactly the ``n_sources`` training ranks is sent as their rows."""
    specs = []
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        dt = cast if cast is not None and t.is_floating_point() else t.dtype
        group = row_shard_group(t)
        split = group is not None and len(t.shape) > 0 and t.shape[0] > 0 and dist.get_world_size(group) == n_sources
        specs.append(TensorSpec(name, tuple(t.shape), dtype_name(dt), split))
    if not specs:
        raise ValueError("weight sync: the model has no tensors to send")
    specs_t = tuple(specs)
    return WeightHeader(int(version), int(seq), specs_t, plan_buckets(specs_t, bucket_bytes), int(n_sources))


def views(header: WeightHeader, b: int, buf: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """The tensors of bucket ``b`` as views into its byte buffer ``buf``."""
    for spec, off in header.layout(b):
        yield spec, buf[off:off + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)
