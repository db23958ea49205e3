"""A same-host transport: Unix stream sockets in Linux's abstract namespace, no I/O thread.

A ZMQ message between two processes passes through an I/O thread on each side: the sending
thread wakes its I/O thread, which writes to the kernel, and the receiver's I/O thread reads
it and wakes the receiving thread. Every hop is a thread wake-up, which on a virtual machine
is an interrupt between CPUs. Here the sending thread writes the message to the socket and
the receiving thread reads it: one wake-up a message.

``UnixDealer`` (a client's one connection) and ``UnixRouter`` (a server's listening socket
and its connections) offer the part of ``zmq.Socket`` that the RPC layer uses:
``send_multipart``, ``recv_multipart``, ``poll``, ``getsockopt(EVENTS | FD)``, ``fileno``,
``close``; ``sockets.open_socket`` makes one for a ``unix://@<name>`` address. The file
descriptor they show an event loop (or ``zmq.zmq_poll``) is an epoll instance over their
sockets: readable when there is something to read, or room to write what waits.

A message on the wire: its frame count (uint32), each frame's length (uint64), the frames.
What is written and read is never pickled. A frame received is a ``Frame`` over the
message's own buffer (writable: tensors are rebuilt over it without a copy).

Like ZMQ: a send never blocks a non-blocking caller (a message the socket cannot take yet
waits in order, up to ``MAX_WAITING_BYTES``, then ``zmq.Again``); a reply to a peer that has
gone is refused with EHOSTUNREACH, as from a ROUTER with ROUTER_MANDATORY; a peer that closes
leaves its calls to time out. Unlike ZMQ: ``connect`` needs the server to be listening, and
there is no reconnection (a restarted server has a new address).
"""
from __future__ import annotations

import collections
import errno
import functools
import itertools
import math
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

SCHEME = "unix://"
MAX_FRAMES = 1 << 16  # a message with more frames is a protocol error
MAX_MESSAGE_BYTES = 1 << 40
MAX_WAITING_BYTES = 1 << 30  # bytes a peer has not taken yet before a non-blocking send says Again
_IOV = 512  # buffers per sendmsg call (below the kernel's IOV_MAX)
_BIG = 1 << 16  # the rest of a message body at least this large is read straight into it
_SCRATCH = 1 << 18
_COUNT = struct.Struct("<I")
_LINGER, _ROUTER_MANDATORY, _EVENTS, _FD = int(zmq.LINGER), int(zmq.ROUTER_MANDATORY), int(zmq.EVENTS), int(zmq.FD)
_POLLIN, _POLLOUT, _NOBLOCK = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)
_IGNORED_OPTIONS = {_LINGER, _ROUTER_MANDATORY, int(zmq.SNDHWM), int(zmq.RCVHWM)}


def is_unix(address: str) -> bool:
    return address.startswith(SCHEME)


def new_address(label: str) -> str:
    """A fresh ``unix://@...`` address (abstract namespace: no file, nothing left behind)."""
    return f"{SCHEME}@asyncflow-{label}-{os.getpid()}-{os.urandom(6).hex()}"


def _abstract_name(address: str) -> str:
    name = address[len(SCHEME):] if is_unix(address) else ""
    if not name.startswith("@") or len(name) < 2:
        raise ValueError(f"unix transport address {address!r} must be '{SCHEME}@<name>' (Linux's abstract "
                         "socket namespace)")
    return "\0" + name[1:]


class Frame:
    """A received frame: ``buffer`` (a writable memoryview over the message) and ``bytes``,
    as a zmq.Frame has them."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview):
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


def _bytes_of(frame: Any) -> memoryview:
    mem = frame.buffer if hasattr(frame, "buffer") else frame
    view = memoryview(mem)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_frames(frames: Sequence[Any]) -> list[memoryview]:
    """A message's buffers as written: its header, then each non-empty frame."""
    bufs = [_bytes_of(f) for f in frames]
    head = struct.pack(f"<I{len(bufs)}Q", len(bufs), *(b.nbytes for b in bufs))
    return [memoryview(head), *(b for b in bufs if b.nbytes)]


class ProtocolError(ConnectionError):
    """A peer sent bytes that are not a message of this transport."""


class Stream:
    """One connected socket: the messages read from it, the bytes waiting to be written."""

    def __init__(self, sock: socket.socket, name: str):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.name = name
        self.eof = False
        self._scratch = bytearray(_SCRATCH)
        self._head = bytearray()
        self._count = 0
        self._lens: tuple[int, ...] = ()
        self._body: bytearray | None = None
        self._got = 0
        self.out: collections.deque[memoryview] = collections.deque()
        self.waiting_bytes = 0

    # ---- reading --------------------------------------------------------------------------
    def read(self, emit: Callable[[list[Any]], None]) -> None:
        """Take in what the socket holds, never blocking; each whole message goes to ``emit``."""
        while not self.eof:
            body = self._body
            if body is not None and len(body) - self._got >= _BIG:
                view: memoryview = memoryview(body)[self._got:]
            else:
                view = memoryview(self._scratch)
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # reset by a peer that died: gone, like a clean close
                if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                    raise
                n = 0
            if n == 0:
                self.eof = True
                return
            if view.obj is body:
                self._got += n
                if self._got == len(body):
                    self._finish(emit)
            else:
                self._feed(view[:n], emit)

    def _feed(self, data: memoryview, emit: Callable[[list[Any]], None]) -> None:
        while data.nbytes:
            if self._body is None:
                want = 4 if len(self._head) < 4 else 4 + 8 * self._count
                take = min(want - len(self._head), data.nbytes)
                self._head += data[:take]
                data = data[take:]
                if len(self._head) < want:
                    return
                if want == 4:
                    self._count = _COUNT.unpack_from(self._head)[0]
                    if not 0 < self._count <= MAX_FRAMES:
                        raise ProtocolError(f"{self.name}: a message of {self._count} frames (at most {MAX_FRAMES})")
                    continue
                self._lens = struct.unpack_from(f"<{self._count}Q", self._head, 4)
                total = sum(self._lens)
                if total > MAX_MESSAGE_BYTES:
                    raise ProtocolError(f"{self.name}: a message of {total} bytes")
                self._head, self._body, self._got = bytearray(), bytearray(total), 0
                if total == 0:
                    self._finish(emit)
            else:
                take = min(len(self._body) - self._got, data.nbytes)
                self._body[self._got:self._got + take] = data[:take]
                self._got += take
                data = data[take:]
                if self._got == len(self._body):
                    self._finish(emit)

    def _finish(self, emit: Callable[[list[Any]], None]) -> None:
        body = self._body
        assert body is not None  # called when the body is whole
        mem, frames, at = memoryview(body), [], 0
        for n in self._lens:
            frames.append(Frame(mem[at:at + n]))
            at += n
        self._body, self._lens = None, ()
        emit(frames)

    # ---- writing --------------------------------------------------------------------------
    def queue(self, frames: Sequence[Any]) -> None:
        for b in encode_frames(frames):
            self.out.append(b)
            self.waiting_bytes += b.nbytes

    def flush(self) -> bool:
        """Write what waits without blocking; True when nothing is left (or the peer is gone:
        what it did not take is dropped, as ZMQ drops messages to a peer that left)."""
        out = self.out
        while out:
            try:
                n = self.sock.sendmsg(list(itertools.islice(out, _IOV)))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
                self.eof = True
                out.clear()
                self.waiting_bytes = 0
                return True
            self.waiting_bytes -= n
            while n:
                b = out[0]
                if b.nbytes <= n:
                    n -= b.nbytes
                    out.popleft()
                else:
                    out[0] = b[n:]
                    n = 0
        return True

    def close(self) -> None:
        self.sock.close()


class _Endpoint:
    """What both ends share: the epoll the outside world waits on, the inbox, the options."""

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._inbox: collections.deque[list[Any]] = collections.deque()
        self.closed = False

    def fileno(self) -> int:
        return self._ep.fileno()

    def setsockopt(self, option: int, value: Any) -> None:
        if int(option) not in _IGNORED_OPTIONS:
            raise ValueError(f"the unix transport has no socket option {option!r}")

    def getsockopt(self, option: int) -> int:
        if option == _FD:
            return self._ep.fileno()
        if option == _EVENTS:
            self._pump(0.0)
            return (_POLLIN if self._inbox else 0) | _POLLOUT
        raise ValueError(f"the unix transport has no socket option {option!r}")

    def _pump(self, timeout: float) -> None:
        raise NotImplementedError

    def poll(self, timeout: int | None = None, flags: int = _POLLIN) -> int:
        """Wait up to ``timeout`` ms (None or -1: no limit) for a whole message; POLLIN or 0."""
        self._pump(0.0)
        deadline = math.inf if timeout is None or timeout < 0 else time.monotonic() + timeout / 1000
        while not self._inbox and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._pump(min(left, 3600.0))  # a part of a message may wake it: wait on for the rest
        return _POLLIN if self._inbox and flags & _POLLIN else 0

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        if not self._inbox:
            self._pump(0.0)
        while not self._inbox:
            if flags & _NOBLOCK:
                raise zmq.Again()
            if self.closed:
                raise zmq.ZMQError(errno.ENOTSOCK, "the socket is closed")
            self._pump(-1.0)
        return self._inbox.popleft()

    def _send(self, stream: Stream, frames: Sequence[Any], flags: int) -> None:
        if flags & _NOBLOCK and stream.waiting_bytes > MAX_WAITING_BYTES:
            raise zmq.Again()
        stream.queue(frames)
        while not stream.flush():
            if flags & _NOBLOCK:
                self._ep.modify(stream.fd, select.EPOLLIN | select.EPOLLOUT)
                return
            room = select.poll()  # a blocking sender waits for room (the reader never blocks on it)
            room.register(stream.fd, select.POLLOUT)
            room.poll()


class UnixDealer(_Endpoint):
    """A client's connection to one ``UnixRouter``."""

    def __init__(self) -> None:
        super().__init__()
        self._stream: Stream | None = None
        self._watched = False  # the stream is in the epoll

    def connect(self, address: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_abstract_name(address))
        except OSError as e:
            sock.close()
            raise ConnectionError(f"nothing listens at {address} ({e}): is the service there started, on this "
                                  f"host?") from None
        self._stream = Stream(sock, f"connection to {address}")
        self._ep.register(self._stream.fd, select.EPOLLIN)
        self._watched = True

    def _pump(self, timeout: float) -> None:
        s = self._stream
        if s is None or self.closed:
            return
        if timeout != 0.0:
            self._ep.poll(timeout)  # with the peer gone nothing is watched: it waits the whole time
        if s.out and s.flush() and self._watched:
            self._ep.modify(s.fd, select.EPOLLIN)
        s.read(self._inbox.append)
        if s.eof and self._watched:
            # A closed peer's socket stays readable (EOF) and hung up: out of the epoll, so
            # that a loop watching it does not spin. The calls in flight time out, as with ZMQ.
            self._ep.unregister(s.fd)
            self._watched = False

    def send_multipart(self, frames: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        if self._stream is None:
            raise zmq.ZMQError(errno.ENOTCONN, "connect the unix transport client first")
        if self._stream.eof:  # the server has gone: dropped, and the call times out, as with ZMQ
            return
        self._send(self._stream, frames, flags)

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self.closed = True
            if self._stream is not None:
                self._stream.close()
            self._ep.close()


class UnixRouter(_Endpoint):
    """A server's listening socket and its connections; a received message starts with the
    identity of the connection it came by, and a reply starts with it."""

    def __init__(self) -> None:
        super().__init__()
        self._listener: socket.socket | None = None
        # fd -> (identity, stream, what hands its messages to the inbox)
        self._streams: dict[int, tuple[bytes, Stream, Callable[[list[Any]], None]]] = {}
        self._by_ident: dict[bytes, Stream] = {}
        self._ids = itertools.count(1)
        self.address = ""

    def bind(self, address: str) -> str:
        if self._listener is not None:
            raise ValueError(f"this unix transport server already listens at {self.address}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(_abstract_name(address))
        except OSError as e:
            sock.close()
            raise zmq.ZMQError(e.errno or errno.EADDRINUSE, f"cannot listen at {address}: {e}") from None
        sock.listen(256)
        sock.setblocking(False)
        self._listener, self.address = sock, address
        self._ep.register(sock.fileno(), select.EPOLLIN)
        return address

    def _pump(self, timeout: float) -> None:
        if self.closed:
            return
        for fd, events in self._ep.poll(timeout):
            if self._listener is not None and fd == self._listener.fileno():
                self._accept()
                continue
            entry = self._streams.get(fd)
            if entry is None:
                continue
            ident, s, emit = entry
            if events & select.EPOLLOUT and s.flush():
                self._ep.modify(fd, select.EPOLLIN)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                try:
                    s.read(emit)
                except ProtocolError:
                    s.eof = True  # a peer that breaks the protocol is cut off
            if s.eof:
                self._drop(fd, ident, s)

    def _accept(self) -> None:
        assert self._listener is not None  # only called for the listener's events
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            ident = next(self._ids).to_bytes(8, "little")
            s = Stream(sock, f"{self.address} connection {int.from_bytes(ident, 'little')}")
            self._streams[s.fd] = (ident, s, functools.partial(self._arrived, Frame(memoryview(ident))))
            self._by_ident[ident] = s
            self._ep.register(s.fd, select.EPOLLIN)

    def _arrived(self, who: Frame, frames: list[Any]) -> None:
        self._inbox.append([who, *frames])

    def _drop(self, fd: int, ident: bytes, s: Stream) -> None:
        self._ep.unregister(fd)
        del self._streams[fd]
        del self._by_ident[ident]
        s.close()

    def send_multipart(self, frames: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        head = frames[0]
        ident = head if isinstance(head, bytes) else _bytes_of(head).tobytes()
        stream = self._by_ident.get(ident)
        if stream is None or stream.eof:
            raise zmq.ZMQError(errno.EHOSTUNREACH, "the peer has gone")
        self._send(stream, frames[1:], flags)

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self.closed = True
            for _, s, _ in self._streams.values():
                s.close()
            self._streams.clear()
            self._by_ident.clear()
            if self._listener is not None:
                self._listener.close()
            self._ep.close()
