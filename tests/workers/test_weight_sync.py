"""Weight sync, the protocol and its pure parts: buckets, header layout, views, casts."""
from __future__ import annotations

import pytest
import torch

from asyncflow.weight_sync import protocol as ws


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
    out = {s.name: v.clone() for s, v in ws.views(header, 0, buf)}
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


def _split_header(n_sources: int, bucket_bytes: int) -> tuple[ws.WeightHeader, dict[str, torch.Tensor]]:
    # "big": every source's rows of it (a third at most) are DIRECT_BYTES or more
    big_rows = 3 * ws.DIRECT_BYTES // (512 * 4) + 3
    t = {"embed": torch.randn(5, 3), "ids": torch.arange(7), "w": torch.randn(4, 2).to(torch.bfloat16),
         "big": torch.randn(big_rows, 512), "one_row": torch.randn(1, 4), "bias": torch.randn(3)}
    split = {"embed", "w", "big", "one_row", "bias"}  # as FSDP2 shards parameters (not buffers) by rows
    specs = tuple(ws.TensorSpec(k, tuple(v.shape), ws.dtype_name(v.dtype), k in split) for k, v in t.items())
    return ws.WeightHeader(1, 1, specs, ws.plan_buckets(specs, bucket_bytes), n_sources), t


@pytest.mark.parametrize("n_sources,bucket_bytes", [(2, 1 << 20), (2, 64), (3, 96), (1, 1 << 20)])
def test_pieces_cover_every_byte_of_a_bucket_once_with_each_rank_sending_its_own_rows(n_sources, bucket_bytes):
    header, t = _split_header(n_sources, bucket_bytes)
    directs = 0
    for b in range(len(header.buckets)):
        pieces = header.pieces(b)
        assert len(pieces) == n_sources
        # what each rank sends from its own shard (rows as torch.chunk splits them), put back where the
        # receiver's layout has it: the bucket comes out whole and every byte is written exactly once
        full = torch.zeros(header.bucket_nbytes(b), dtype=torch.uint8)
        written = torch.zeros(header.bucket_nbytes(b), dtype=torch.int32)
        for i, msgs in enumerate(pieces):
            for msg in msgs:
                # a run of DIRECT_BYTES or more travels alone (from and into the tensor's own memory)
                assert msg.direct == (len(msg.segments) == 1)
                assert all(sg.nbytes < ws.DIRECT_BYTES for sg in msg.segments) or msg.direct
                directs += msg.direct and msg.segments[0].nbytes >= ws.DIRECT_BYTES
                wire = torch.zeros(msg.nbytes, dtype=torch.uint8)
                for sg in msg.segments:
                    spec = header.specs[sg.index]
                    assert sg.off % 8 == 0
                    if spec.split:
                        chunks = torch.chunk(t[spec.name], n_sources)
                        shard = chunks[i] if i < len(chunks) else t[spec.name][:0]
                        assert sg.rows == ws.chunk_rows(spec.shape[0], n_sources, i)
                        assert shard.shape[0] == sg.rows[1] - sg.rows[0]
                        src = shard
                    else:
                        assert sg.rows is None and i == header.source(b)  # unsplit: whole, from the bucket's source
                        src = t[spec.name]
                    wire[sg.off:sg.off + sg.nbytes].view(src.dtype).view(src.shape).copy_(src)
                for sg in msg.segments:
                    full[sg.at:sg.at + sg.nbytes].copy_(wire[sg.off:sg.off + sg.nbytes])
                    written[sg.at:sg.at + sg.nbytes] += 1
        for spec, off in header.layout(b):
            assert bool((written[off:off + spec.nbytes] == 1).all()), spec.name
        for spec, v in ws.views(header, b, full):
            assert torch.equal(v, t[spec.name]), spec.name
    assert directs == n_sources  # "big": every rank's rows of it alone


def test_a_model_of_small_tensors_goes_as_one_message_and_a_tensor_of_direct_bytes_alone():
    """Every message costs both ends a fixed share of CPU: a small model's tensors (a hidden-128
    decoder's largest, its 128 x 512 MLP projections, are 256 KiB) and any other tensor under
    DIRECT_BYTES share one packed message; a tensor of DIRECT_BYTES travels alone."""
    under = ws.DIRECT_BYTES // 4 - 1  # fp32 elements of a tensor just under the threshold
    named = [(f"mlp{i}", torch.zeros(512, 128)) for i in range(6)] + [("w", torch.zeros(under)),
                                                                       ("norm", torch.zeros(7))]
    header = ws.make_header(named, 1, 1, 64 << 20, 1, None)
    assert len(header.buckets) == 1
    (msgs,) = header.pieces(0)
    assert len(msgs) == 1 and not msgs[0].direct and len(msgs[0].segments) == 8
    header = ws.make_header([*named, ("big", torch.zeros(ws.DIRECT_BYTES // 4))], 1, 1, 64 << 20, 1, None)
    (msgs,) = header.pieces(0)
    assert [m.direct for m in msgs] == [True, False]


def test_a_split_tensor_with_no_rows_sends_nothing_and_breaks_nothing():
    specs = (ws.TensorSpec("empty", (0, 4), "float32", True), ws.TensorSpec("w", (3, 2), "float32", True))
    header = ws.WeightHeader(1, 1, specs, ws.plan_buckets(specs, 1 << 20), 2)
    pieces = header.pieces(0)
    assert [[sg.index for m in msgs for sg in m.segments] for msgs in pieces] == [[1], [1]]


def test_staging_gives_every_bucket_an_aligned_start_whatever_the_sizes_before_it():
    from asyncflow.weight_sync.sinks import StagingSink
    # bucket 0: 3 bf16 values (6 bytes); bucket 1: int64 values, whose views need 8-byte alignment
    t = {"a": torch.randn(3).to(torch.bfloat16), "ids": torch.arange(5)}
    header = ws.make_header(t.items(), 1, 1, bucket_bytes=8, n_sources=1, cast=None)
    assert len(header.buckets) == 2 and header.bucket_nbytes(0) == 6
    sink = StagingSink(lambda sd, v: None)
    sink.begin(header)
    for b in range(2):
        assert sink.bucket_buffer(header, b).data_ptr() % 8 == 0
    for name, v in t.items():
        sink.tensor(next(s for s in header.specs if s.name == name), v)
    sink.end(header)
    _, staged = sink.take()
    assert all(torch.equal(staged[k], t[k]) for k in t)
