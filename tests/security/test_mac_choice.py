"""The sender picks the MAC by the bytes it covers (keyed BLAKE2b for small messages,
HMAC-SHA256 from auth.SHA_FROM_BYTES) and names it in the flags, which the MAC covers:
either verifies, and switching the flag on the way breaks the tag."""
from __future__ import annotations

import torch

from asyncflow.rpc import auth, codec

FLAGS_AT = 2  # version, kind, flags, nonce


def _sealed(nbytes: int) -> list:
    frames = codec.encode({"x": torch.zeros(nbytes, dtype=torch.uint8), "n": 1})
    return [bytes(f) for f in auth.seal(auth.REQUEST, auth.nonce_of(1, 2), frames)]


def test_small_messages_use_blake2b_and_larger_ones_hmac_sha256():
    small, large = _sealed(16), _sealed(auth.SHA_FROM_BYTES)
    assert not small[0][FLAGS_AT] & auth._FLAG_SHA
    assert large[0][FLAGS_AT] & auth._FLAG_SHA
    for msg in (small, large):
        opened = auth.unseal(auth.REQUEST, msg)
        assert opened is not None and codec.decode(opened[1])["n"] == 1


def test_switching_the_mac_flag_breaks_the_tag():
    for msg in (_sealed(16), _sealed(auth.SHA_FROM_BYTES)):
        head = bytearray(msg[0])
        head[FLAGS_AT] ^= auth._FLAG_SHA
        assert auth.unseal(auth.REQUEST, [bytes(head), *msg[1:]]) is None


def test_a_large_frame_change_is_caught_when_it_is_covered():
    msg = _sealed(1000)  # a frame up to SMALL_FRAME is always covered
    data = bytearray(msg[1])
    data[0] ^= 1
    assert auth.unseal(auth.REQUEST, [msg[0], bytes(data)]) is None
