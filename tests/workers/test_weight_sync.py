"""Weight sync, the protocol and its pure parts: buckets, header layout, views, casts."""
from __future__ import annotations

import pytest
import torch

from asyncflow.workers import weight_sync as ws


def _specs(*sizes: int, dtype: str = "float32") -> list[ws.TensorSpec]:
    return [ws.TensorSpec(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_buckets_are_consecutive_runs_within_the_size_and_a_large_tensor_goes_alone():
    specs = _specs(10, 10, 10, 100, 3)  # float32: 40, 40, 40, 400, 12 bytes (aligned: 40, 40, 40, 400, 16)
    assert ws.plan_buckets(specs, 100) == ((0, 2), (2, 3), (3, 4), (4, 5))
    assert ws.plan_buckets(specs, 10_000) == ((0, 5),)
    with pytest.raises(ValueError, match="weight_sync.bucket_mb"):
        ws.plan_buckets(specs, 0)


def test_layout_aligns_every_tensor_and_views_round_trip():
    t = {"a": torch.arange(3, dtype=torch.int8), "b": torch.randn(2, 3), "c": torch.randn(5).to(torch.bfloat16),
         "d": torch.arange(4, dtype=torch.int64)}
    header = ws.make_header(t.items(), version=3, seq=7, bucket_bytes=1 << 20, n_sources=2, cast=None)
    lay = header.layout(0)
    assert [off % 8 for _, off in lay] == [0, 0, 0, 0]
    assert [off for _, off in lay] == [0, 8, 32, 48]
    buf = torch.zeros(header.bucket_nbytes(0), dtype=torch.uint8)
    for spec, v in ws.views(header, 0, buf):
        v.copy_(t[spec.name])
    out = dict((s.name, v.clone()) for s, v in ws.views(header, 0, buf))
    assert all(torch.equal(out[k], t[k]) and out[k].dtype == t[k].dtype for k in t)
    assert header.nbytes == sum(x.numel() * x.element_size() for x in t.values())


def test_the_header_casts_floating_tensors_only_and_sources_alternate():
    t = {"w": torch.randn(4, 4), "ids": torch.arange(5), "b": torch.randn(4)}
    header = ws.make_header(t.items(), 1, 1, bucket_bytes=64, n_sources=2, cast=torch.bfloat16)
    assert [s.dtype for s in header.specs] == ["bfloat16", "int64", "bfloat16"]
    assert [header.source(b) for b in range(len(header.buckets))] == [b % 2 for b in range(len(header.buckets))]
    assert len(header.buckets) >= 2


def test_a_non_tensor_or_an_empty_model_is_refused_by_name():
    with pytest.raises(TypeError, match="'x'"):
        ws.make_header([("x", 3)], 0, 0, 1024, 1, None)
    with pytest.raises(ValueError, match="no tensors"):
        ws.make_header([], 0, 0, 1024, 1, None)
