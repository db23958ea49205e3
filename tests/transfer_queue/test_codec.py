"""The wire codec: nested structures round trip; a message can fail to decode, but only
with CodecError, and only whitelisted dtypes come off the wire."""
from __future__ import annotations

import json
import math

import pytest
import torch
import zmq

from asyncflow.rpc.codec import CodecError, decode, dtype_from_name, dtype_name, encode


def _frames(header: dict, *bufs: bytes) -> list:
    return [json.dumps(header).encode(), *bufs]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def test_nested_structure_of_json_values_and_tensors_round_trips():
    g = torch.Generator().manual_seed(0)
    msg = {
        "id": 7, "m": "put", "none": None, "flag": True, "pi": 3.25, "nan": float("nan"), "s": "ünï ✓",
        "a": {
            "ints": torch.arange(10, dtype=torch.int64),
            "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "list": [torch.zeros(0, 5), {"deep": [torch.tensor([True, False]), 1, "x"]}],
            "c64": torch.randn(2, generator=g, dtype=torch.complex64),
            "u8": torch.tensor([0, 255], dtype=torch.uint8),
            "f16": torch.tensor([1.5, -2.0], dtype=torch.float16),
        },
    }
    frames = encode(msg)
    assert len(frames) == 1 + 7  # header + one frame per tensor
    assert _same(decode(frames), msg)
    assert _same(decode([bytes(f) for f in frames]), msg)  # from bytes as well as buffers


def test_tuples_become_lists_and_keys_become_strings():
    assert decode(encode({1: (torch.tensor([2]), 3)}))["1"][1] == 3


def test_non_contiguous_and_scalar_tensors_round_trip():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base.t(), base[:, ::2], torch.tensor(5.0), base[1:3]):
        (out,) = decode(encode([t]))
        assert out.shape == t.shape and torch.equal(out, t)


def test_decoded_tensors_use_the_received_frames_without_copy():
    data = torch.arange(16, dtype=torch.int32)
    frames = [zmq.Frame(bytes(f)) for f in encode({"t": data})]
    out = decode(frames)["t"]
    assert torch.equal(out, data)
    mem = frames[1].buffer
    assert out.data_ptr() == torch.frombuffer(mem, dtype=torch.uint8).data_ptr()


def test_tensor_frame_holds_exactly_the_tensor_bytes():
    t = torch.zeros(7, 3, dtype=torch.bfloat16)
    header, buf = encode(t)
    assert buf.nbytes == 7 * 3 * 2
    assert json.loads(header) == {"__t": 0, "d": "bfloat16", "s": [7, 3]}


@pytest.mark.parametrize("name", ["object", "float8_e4m3fn", "Tensor", "__class__", "float32; import os", ""])
def test_header_naming_an_unknown_dtype_raises_codec_error(name):
    with pytest.raises(CodecError, match="unknown dtype"):
        decode(_frames({"__t": 0, "d": name, "s": [1]}, b"\x00" * 4))
    with pytest.raises(CodecError):
        dtype_from_name(name)


def test_dtype_whitelist_names_round_trip_and_unsupported_dtypes_cannot_be_sent():
    for d in (torch.bool, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64):
        assert dtype_from_name(dtype_name(d)) is d
    with pytest.raises(CodecError, match="cannot be sent"):
        encode({"x": torch.zeros(2, dtype=torch.float8_e4m3fn)})


@pytest.mark.parametrize("nbytes", [0, 11, 13, 100])
def test_frame_with_the_wrong_byte_count_raises(nbytes):
    with pytest.raises(CodecError, match=f"has {nbytes} bytes, header says \\[3\\] of float32"):
        decode(_frames({"__t": 0, "d": "float32", "s": [3]}, b"\x00" * nbytes))


def test_header_pointing_at_a_missing_frame_raises():
    with pytest.raises(CodecError, match="tensor frame 1 missing: message has 1 data frames"):
        decode(_frames({"x": {"__t": 1, "d": "int8", "s": [1]}}, b"\x00"))
    with pytest.raises(CodecError, match="missing"):
        decode(_frames({"__t": "0", "d": "int8", "s": [1]}, b"\x00"))


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe\x00", b"", b'{"a": [1, 2}'])
def test_malformed_header_raises_codec_error(header):
    with pytest.raises(CodecError, match="bad header frame"):
        decode([header])


def test_empty_message_raises_codec_error():
    with pytest.raises(CodecError, match="empty message"):
        decode([])


def test_values_that_are_not_json_cannot_be_encoded():
    with pytest.raises(CodecError, match="only JSON values and tensors travel"):
        encode({"x": {1, 2}})
    with pytest.raises(CodecError, match="only JSON values and tensors travel"):
        encode({"x": object()})


def test_reserved_key_cannot_be_encoded():
    """A user dict using the codec's tensor key would be misread as a tensor reference on
    the other side (and the message dropped there); the sender must refuse it."""
    with pytest.raises(CodecError, match="reserved"):
        encode({"__t": 1})
    with pytest.raises(CodecError, match="reserved"):
        encode({"items": [{"meta": {"__t": 0, "d": "int8", "s": [1]}}]})


def test_tensors_decoded_from_zmq_frames_stay_picklable_and_resend_their_frame():
    """A storage unit resends a received frame as is; the tensor that remembers it must still
    pickle (workers broadcast fetched batches with broadcast_object_list)."""
    import pickle

    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        a.send_multipart(encode({"x": torch.arange(100_000)}), copy=False)
        got = decode(b.recv_multipart(copy=False))["x"]
        assert torch.equal(pickle.loads(pickle.dumps(got)), torch.arange(100_000))
        frames = encode({"y": got})
        assert isinstance(frames[1], zmq.Frame)  # the received frame itself goes back out
        b.send_multipart(frames, copy=False)
        assert torch.equal(decode(a.recv_multipart(copy=False))["y"], torch.arange(100_000))
        assert not isinstance(encode({"z": got[1:]})[1], zmq.Frame)  # a view is encoded anew
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_copy_message_gives_what_encode_then_decode_gives_and_shares_no_tensor():
    from asyncflow.rpc.codec import copy_message
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    msg = {"a": (t[:, ::2], 3), 1: {"bf": torch.ones(2, dtype=torch.bfloat16)}, "s": 'a"__t":b', "n": None}
    out = copy_message(msg)
    assert _same(out, decode(encode(msg)))
    assert out["a"][0].is_contiguous() and out["a"][0].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    t.zero_()  # the caller writes its tensor: the copy keeps what was sent
    assert out["a"][0][0].tolist() == [0.0, 2.0, 4.0] and out["a"][0][1].tolist() == [6.0, 8.0, 10.0]


@pytest.mark.parametrize("msg", [{"x": {1, 2}}, {"__t": 1}, {"x": torch.zeros(2, dtype=torch.uint32)}])
def test_copy_message_refuses_what_encode_refuses(msg):
    from asyncflow.rpc.codec import copy_message
    with pytest.raises(CodecError) as wire:
        encode(msg)
    with pytest.raises(CodecError) as copied:
        copy_message(msg)
    assert str(copied.value) == str(wire.value)
