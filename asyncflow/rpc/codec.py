"""Zero-copy wire codec: a JSON header frame plus one raw frame per tensor.

Any structure of JSON values and tensors is encoded as ``[header, buf0, buf1, ...]``.
Tensors never go through pickle: their bytes travel as separate ZMQ frames sent with
``copy=False`` and are rebuilt on receipt with ``torch.frombuffer`` over the frame's
memory, so a payload is copied by the kernel only. Nothing here unpickles, so a
message from the network can at worst fail to decode; it cannot execute code.
"""
from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..cpu_account import charged

_TENSOR_KEY = "__t"
_TENSOR_MARK = b'"__t":'
# Tensor (by identity) -> the received zmq.Frame it was decoded from, whole. A side table,
# not an attribute: the tensor must stay picklable. Entries leave with their tensor.
_FRAMES: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}


def _remember_frame(t: torch.Tensor, frame: Any) -> None:
    key = id(t)

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _FRAMES.pop(key, None)

    _FRAMES[key] = (weakref.ref(t, forget), frame)


def _frame_of(t: torch.Tensor) -> Any:
    entry = _FRAMES.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None

# Only these dtypes may come off the wire: a header cannot name an arbitrary attribute.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
    )
}


_ITEMSIZE = {d: torch.empty(0, dtype=d).element_size() for d in _DTYPES.values()}


class CodecError(ValueError):
    """A message could not be encoded or decoded."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CodecError(f"dtype {dtype} cannot be sent; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r} in message; supported: {sorted(_DTYPES)}") from None


def _tensor_frame(t: torch.Tensor) -> memoryview:
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are what travel
        t = t.view(torch.int16)
    if t.numel() == 0:
        return memoryview(b"")
    return t.numpy().data.cast("B")  # the array's own buffer (ndarray.data), as bytes


def _header(obj: Any, tensor_ref: Callable[[torch.Tensor], dict[str, Any]]) -> bytes:
    """The JSON header of ``obj``, each tensor written as ``tensor_ref(tensor)`` (a dict under
    _TENSOR_KEY); tuples as lists; CodecError for anything else JSON cannot write, and for a dict
    of the message's own that uses the reserved key."""
    refs = 0

    def default(x: Any) -> Any:  # json calls this for what it cannot encode itself
        nonlocal refs
        if isinstance(x, torch.Tensor):
            refs += 1
            return tensor_ref(x)
        if isinstance(x, tuple):
            return list(x)
        raise TypeError(f"{type(x).__name__} is not JSON-serialisable")

    try:
        # The C encoder walks lists of row ids at native speed; tensors come back through default.
        header = json.dumps(obj, separators=(",", ":"), default=default).encode()
    except (TypeError, ValueError) as e:
        raise CodecError(f"cannot encode message: {e}; only JSON values and tensors travel") from e
    # Each tensor reference writes the key once; any other use would be misread on receipt.
    # (A string containing it is escaped by JSON and cannot match.)
    if header.count(_TENSOR_MARK) != refs:
        raise CodecError(f"dict key {_TENSOR_KEY!r} is reserved by the wire codec; rename that key")
    return header


@charged("serialization")
def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames: ``[header_bytes, *tensor_buffers]``."""
    buffers: list[Any] = []

    def tensor_ref(x: torch.Tensor) -> dict[str, Any]:
        ref = {_TENSOR_KEY: len(buffers), "d": dtype_name(x.dtype), "s": list(x.shape)}
        # A tensor decoded from a whole frame goes back out as that frame: ZMQ shares the
        # message by reference count, with no new zero-copy bookkeeping.
        frame = _frame_of(x)
        buffers.append(frame if frame is not None else _tensor_frame(x))
        return ref

    return [_header(obj, tensor_ref), *buffers]


@charged("serialization")
def copy_message(obj: Any) -> Any:
    """What ``decode(encode(obj))`` gives, without the frames: the same JSON values (tuples as
    lists, the same refusals) and a copy of every tensor (contiguous, on the CPU). For a
    service called in-process: caller and service share no tensor or container, as over the wire."""
    tensors: list[torch.Tensor] = []

    def tensor_ref(x: torch.Tensor) -> dict[str, Any]:
        dtype_name(x.dtype)  # the codec's refusal of a dtype that cannot travel
        tensors.append(x)
        return {_TENSOR_KEY: len(tensors) - 1}

    header = _header(obj, tensor_ref)
    if not tensors:
        return json.loads(header)

    def hook(d: dict[str, Any]) -> Any:
        if _TENSOR_KEY not in d:
            return d
        return tensors[d[_TENSOR_KEY]].detach().cpu().clone(memory_format=torch.contiguous_format)

    return json.loads(header, object_hook=hook)


@charged("serialization")
def decode(frames: Sequence[Any]) -> Any:
    """Inverse of :func:`encode`. Frames may be ``bytes`` or ``zmq.Frame`` objects.

    Tensors returned share memory with the frames (zero copy): clone before writing.
    """
    if not frames:
        raise CodecError("empty message")
    head = frames[0]
    raw = head.bytes if hasattr(head, "bytes") else bytes(head)
    bufs = frames[1:]

    def tensor(spec: dict[str, Any]) -> torch.Tensor:
        i = spec[_TENSOR_KEY]
        if not isinstance(i, int) or not 0 <= i < len(bufs):
            raise CodecError(f"tensor frame {i!r} missing: message has {len(bufs)} data frames")
        dtype = dtype_from_name(spec["d"])
        shape = spec["s"]
        frame = bufs[i]
        # bytes are read-only and torch warns on them; zmq frames are writable.
        mem = frame.buffer if hasattr(frame, "buffer") else memoryview(bytearray(frame))
        numel = 1
        for d in shape:
            numel *= int(d)
        if mem.nbytes != numel * _ITEMSIZE[dtype]:
            raise CodecError(f"tensor frame {i} has {mem.nbytes} bytes, header says {shape} of {spec['d']}")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(mem, dtype=dtype)
        if len(shape) != 1:  # frombuffer is already 1-D: skip a view op per column (most are 1-D)
            t = t.view(shape)
        if hasattr(frame, "buffer"):  # a zmq.Frame: remember it (views made later are new objects)
            _remember_frame(t, frame)
        return t

    def hook(d: dict[str, Any]) -> Any:
        return tensor(d) if _TENSOR_KEY in d else d

    try:
        # No tensor reference can hide in a header without the mark (JSON escapes the
        # quotes of strings): the C decoder alone then, with no Python hook per dict.
        if _TENSOR_MARK not in raw:
            return json.loads(raw)
        return json.loads(raw, object_hook=hook)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"bad header frame: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CodecError):
            raise
        raise CodecError(f"bad tensor reference in header: {e!r}") from e
