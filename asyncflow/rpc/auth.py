"""Message authentication for every ZMQ message of a run.

Each run has one secret key (32 random bytes). Rank 0 creates it and hands it to every
rank through torchrun's TCPStore (``single_controller.rendezvous.share_run_key``); a
storage unit started on its own reads it from that store or from ``ASYNCFLOW_RUN_KEY``.
Every request and every reply travels as ``[tag + header, *data frames]``: ``tag`` is a
MAC (keyed BLAKE2b for small messages, HMAC-SHA256 from 4 KiB covered) under the run key over the
message's kind, a nonce, the number and length of every frame and the header (and, by
option, every data byte). A receiver checks the tag before ``codec.decode`` sees a byte:
a message that fails is dropped and counted, never decoded, never executed.

What the MAC covers, and why not always every byte: the header carries the method, the
arguments, the schema of every tensor frame and every JSON value (the only things ever
turned into Python objects), and all frames up to ``SMALL_FRAME`` bytes are covered too
(row ids of a BatchMeta, scalars). Large raw tensor frames (sample data) are by default
covered by count and length only: hashing every data byte, on each side of each hop,
costs time in proportion to the data and dominates a TransferQueue round trip, while the
default coverage is a small part of a put's cost (see perf/RESULTS.md, section "Message
authentication"). A sender without the key cannot make a valid tag at all, and ZMQ
delivers a multipart message whole from one connection, so nobody can splice frames into
another peer's message; only an attacker on the wire path could swap those bytes, and
such an attacker already reads everything (there is no encryption). ``ASYNCFLOW_MAC_ALL_FRAMES=1`` (or
``set_cover_all(True)``) covers every byte and makes receivers insist on it.

Replays: the nonce is (sender id, counter); sender ids are random per socket, so a
reconnecting or restarted client is simply a new sender, and a server keeps a sliding
window of the counters it has seen per sender (tolerating the small reordering of
concurrent async sends). A reply echoes its request's nonce and a client accepts it only
for a request still waiting, so a recorded reply cannot be played again. Not covered:
replaying a recorded request once to an endpoint that never heard from that sender (the
receiver's address is not in the MAC: clients may name a server differently than it
named itself), and no timestamps (clocks of nodes need not agree).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from .store_wait import wait_for_value

log = logging.getLogger(__name__)

KEY_BYTES = 32
ENV_VAR = "ASYNCFLOW_RUN_KEY"  # hex; fallback for processes started outside torchrun's store
COVER_ALL_ENV = "ASYNCFLOW_MAC_ALL_FRAMES"
STORE_KEY = "asyncflow/run_key"
SMALL_FRAME = 64 * 1024  # data frames up to this size are always covered: ids and scalars, cheap to hash

VERSION = 1
REQUEST, REPLY = b"Q", b"R"
_FLAG_ALL = 1
_NONCE = struct.Struct("<QQ")  # sender id, counter
_PREFIX = struct.Struct("<BcB16s")  # version, kind, flags, nonce
TAG_BYTES = _PREFIX.size + 32

_key: bytes | None = None
_key_source = ""  # "installed" | "environment" | "generated" once known
_key_used = False
_lock = threading.Lock()
_cover_all = os.environ.get(COVER_ALL_ENV, "") not in ("", "0")


class AuthError(RuntimeError):
    """The run key is missing, malformed, or changed after use."""


# ---- the run key ----------------------------------------------------------------------

def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _check(key: bytes, where: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise AuthError(f"run key from {where} must be {KEY_BYTES} bytes, got "
                        f"{len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}")
    return bytes(key)


def key_from_env() -> bytes | None:
    """The key in ``ASYNCFLOW_RUN_KEY`` (hex), or None when the variable is unset."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw.strip())
    except ValueError:
        raise AuthError(f"{ENV_VAR} must be {2 * KEY_BYTES} hex digits") from None
    return _check(key, ENV_VAR)


def set_run_key(key: bytes, *, export_env: bool = True) -> None:
    """Install the run's key in this process before any socket is made.

    ``export_env`` also puts it (hex) in this process's environment so that processes it
    starts (multiprocessing children, a storage unit subprocess) join the same run; the
    environment of a process is readable only by its user, like its memory. Installing a
    different key after messages were signed or checked with the old one is an error:
    sockets made before would stop understanding each other.
    """
    global _key, _key_source
    key = _check(key, "set_run_key")
    with _lock:
        if _key is not None and _key != key and _key_used:
            raise AuthError("the run key was changed after messages were signed with the old one: "
                            "install it before creating any RPC server or client")
        _key, _key_source = key, "installed"
    if export_env:
        os.environ[ENV_VAR] = key.hex()


def run_key() -> bytes:
    """The key in use: the installed one, else ``ASYNCFLOW_RUN_KEY``, else a new key for
    this process (exported so its children share it: a single-process service with its
    clients, tests and benchmarks need no set-up)."""
    global _key, _key_used, _key_source
    key = _key
    if key is None:
        with _lock:
            if _key is None:
                env = key_from_env()
                if env is not None:
                    _key, _key_source = env, "environment"
                else:
                    _key, _key_source = generate_key(), "generated"
                    os.environ[ENV_VAR] = _key.hex()
            key = _key
    _key_used = True
    return key


def wait_key_in_store(store: Any, timeout_s: float, who: str = "this process") -> bytes:
    """The run key from a torch.distributed Store, waiting up to ``timeout_s`` for rank 0 to put
    it there; TimeoutError naming the key and ``who`` waited."""
    return wait_for_value(store, STORE_KEY, timeout_s, who, f"the run key ({STORE_KEY!r})")


def key_source() -> str:
    """Where this process's key came from: "installed" (set_run_key), "environment"
    (inherited ``ASYNCFLOW_RUN_KEY``), "generated" (made here), or "" (not yet known)."""
    return _key_source


def _generate_at_import() -> None:
    """A process with no key makes one as soon as this module is imported and
    exports it, so children it starts later (spawn, forkserver, subprocess) share it even
    when the parent itself sends nothing first. Not counted as use: set_run_key (rank
    start-up) may still replace it."""
    global _key, _key_source
    if not os.environ.get(ENV_VAR):
        _key, _key_source = generate_key(), "generated"
        os.environ[ENV_VAR] = _key.hex()


def set_cover_all(on: bool) -> None:
    """Cover every byte of every frame (and require it of received messages)."""
    global _cover_all
    _cover_all = bool(on)


def cover_all() -> bool:
    return _cover_all


# ---- tags -----------------------------------------------------------------------------
# The tag rides in front of the header frame, not in a frame of its own: one more frame
# costs more per round trip than the MAC itself.
#
# The MAC: the sender picks it by the bytes it covers, and says which in the flags (inside
# the MAC, so it cannot be switched on the way). Keyed BLAKE2b for a message that covers
# little (header and a few small frames), where its lower cost per message counts;
# HMAC-SHA256 from SHA_FROM_BYTES covered, and always when every byte is covered, where its
# higher throughput on CPUs with SHA extensions counts (a TQ payload's small frames already
# hash faster with it). Figures: perf/RESULTS.md, section "Message authentication".

_FLAG_SHA = 2  # HMAC-SHA256 (implied by _FLAG_ALL); else keyed BLAKE2b
SHA_FROM_BYTES = 4096

_KEYED: dict[tuple[bytes, bool], Any] = {}  # (key, sha256) -> a keyed hash object to copy


def _keyed(key: bytes, sha: bool) -> Any:
    h = _KEYED.get((key, sha))
    if h is None:
        h = hmac.new(key, digestmod=hashlib.sha256) if sha else hashlib.blake2b(key=key, digest_size=32)
        _KEYED[(key, sha)] = h
    return h


def _mem(frame: Any) -> Any:
    """A buffer over a frame without copying (zmq.Frame, bytes or memoryview)."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def _covered(header: Any, data: Sequence[Any], all_frames: bool) -> tuple[list[Any], list[int], int]:
    """Buffers of the data frames, their lengths, and how many bytes the MAC reads."""
    mems = [_mem(f) for f in data]
    lens = [memoryview(m).nbytes for m in mems]
    return mems, lens, memoryview(header).nbytes + sum(n for n in lens if all_frames or n <= SMALL_FRAME)


def _mac(key: bytes, prefix: bytes, header: Any, mems: list[Any], lens: list[int], all_frames: bool,
         sha: bool) -> bytes:
    h = _keyed(key, sha).copy()
    h.update(prefix)
    h.update(struct.pack(f"<QI{len(lens)}Q", memoryview(header).nbytes, len(lens), *lens))
    h.update(header)
    for m, n in zip(mems, lens):
        if all_frames or n <= SMALL_FRAME:
            h.update(m)
    tag: bytes = h.digest()
    return tag


def seal(kind: bytes, nonce: bytes, frames: Sequence[Any], key: bytes | None = None) -> list[Any]:
    """``[header, *data]`` (codec frames) -> ``[tag + header, *data]``, sent as ``kind``."""
    header = frames[0]
    mems, lens, covered = _covered(header, frames[1:], _cover_all)
    sha = _cover_all or covered >= SHA_FROM_BYTES
    flags = (_FLAG_ALL if _cover_all else 0) | (_FLAG_SHA if sha else 0)
    prefix = _PREFIX.pack(VERSION, kind, flags, nonce)
    tag = prefix + _mac(key if key is not None else run_key(), prefix, header, mems, lens, _cover_all, sha)
    return [tag + bytes(_mem(header)), *frames[1:]]


def unseal(kind: bytes, frames: Sequence[Any], key: bytes | None = None) -> tuple[bytes, list[Any]] | None:
    """``(nonce, [header, *data])`` of a message whose tag is valid for ``kind``, else None.
    Reads nothing but the tag, the frame lengths and the bytes the MAC covers."""
    if not frames:
        return None
    head = memoryview(_mem(frames[0]))
    if head.nbytes < TAG_BYTES:
        return None
    version, got_kind, flags, nonce = _PREFIX.unpack_from(head)
    if version != VERSION or got_kind != kind or (_cover_all and not flags & _FLAG_ALL):
        return None
    header = head[TAG_BYTES:]
    all_frames = bool(flags & _FLAG_ALL)
    mems, lens, _ = _covered(header, frames[1:], all_frames)
    want = _mac(key if key is not None else run_key(), head[:_PREFIX.size].tobytes(), header, mems, lens,
                all_frames, bool(flags & (_FLAG_ALL | _FLAG_SHA)))
    if not hmac.compare_digest(want, head[_PREFIX.size:TAG_BYTES].tobytes()):
        return None
    return nonce, [header, *frames[1:]]


def new_sender_id() -> int:
    return int.from_bytes(secrets.token_bytes(8), "little")


def nonce_of(sender: int, counter: int) -> bytes:
    return _NONCE.pack(sender, counter)


def split_nonce(nonce: bytes) -> tuple[int, int]:
    return _NONCE.unpack(nonce)


class ReplayWindow:
    """Per sender, the counters already accepted (a sliding window of ``size`` behind the
    highest). Memory is bounded: past ``max_senders``, the sender heard first is forgotten."""

    def __init__(self, size: int = 1024, max_senders: int = 65536):
        self.size = size
        self.max_senders = max_senders
        self._mask = (1 << size) - 1
        self._seen: dict[int, tuple[int, int]] = {}

    def accept(self, nonce: bytes) -> bool:
        """True (and remember it) for a counter not seen before from that sender."""
        sender, counter = _NONCE.unpack(nonce)
        entry = self._seen.get(sender)
        if entry is None:
            if len(self._seen) >= self.max_senders:
                del self._seen[next(iter(self._seen))]
            self._seen[sender] = (counter, 1)
            return True
        top, bits = entry  # bit i set: counter top - i was accepted
        if counter > top:
            shift = counter - top
            bits = ((bits << shift) | 1) & self._mask if shift < self.size else 1
            top = counter
        else:
            back = top - counter
            if back >= self.size or bits >> back & 1:
                return False
            bits |= 1 << back
        self._seen[sender] = (top, bits)
        return True


class FailureLog:
    """Counts dropped messages and logs them at most once per ``every_s`` seconds, so a
    flood of forged messages cannot flood the log."""

    def __init__(self, name: str, every_s: float = 10.0):
        self.name = name
        self.every_s = every_s
        self.count = 0
        self._since = 0
        self._last = -float("inf")

    def dropped(self, why: str) -> None:
        self.count += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            log.warning("%s: dropped %d message(s) that failed authentication (latest: %s); a process "
                        "without this run's key is sending here", self.name, self._since, why)
            self._last, self._since = now, 0


_generate_at_import()
