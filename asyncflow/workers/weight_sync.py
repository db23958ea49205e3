"""Weight sync, the protocol: what a version is on the wire and how it is cut into buckets.

A version goes from the training ranks to the rollout instances as a header, then buckets.
The header lists every tensor (name, shape, dtype after the cast to the rollout dtype) and
cuts the list into buckets of about ``bucket_bytes``, in the model's state-dict order, so
that the senders gather parameters layer after layer. Bucket ``b`` is sent by training
rank ``b % n_sources`` (every training rank takes part) as one flat byte buffer in which
each tensor starts at an 8-byte-aligned offset.

Sending: ``weight_send.py``; receiving and loading: ``weight_recv.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

_ALIGN = 8  # the widest element size: every tensor view into a bucket is aligned


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"

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
            off = _aligned(off + spec.nbytes)
        return out

    def bucket_nbytes(self, b: int) -> int:
        lay = self.layout(b)
        spec, off = lay[-1]
        return off + spec.nbytes

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def describe(self) -> str:
        return f"version {self.version} ({len(self.specs)} tensors, {len(self.buckets)} buckets, {self.nbytes / 2**20:.1f} MiB)"


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """Consecutive runs of ``specs`` of at most ``bucket_bytes`` each (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight sync: bucket size must be positive, got {bucket_bytes} bytes "
                         "(set weight_sync.bucket_mb)")
    out, start, size, n = [], 0, 0, 0
    for i, spec in enumerate(specs):
        need = _aligned(spec.nbytes)
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
    tensors are announced in ``cast`` (the rollout dtype), others as they are."""
    specs = []
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        dt = cast if cast is not None and t.is_floating_point() else t.dtype
        specs.append(TensorSpec(name, tuple(t.shape), dtype_name(dt)))
    if not specs:
        raise ValueError("weight sync: the model has no tensors to send")
    specs_t = tuple(specs)
    return WeightHeader(int(version), int(seq), specs_t, plan_buckets(specs_t, bucket_bytes), int(n_sources))


def views(header: WeightHeader, b: int, buf: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """The tensors of bucket ``b`` as views into its byte buffer ``buf``."""
    for spec, off in header.layout(b):
        yield spec, buf[off:off + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)
