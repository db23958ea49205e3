"""CPU account: which component of the system each thread's CPU time goes to.

Off unless ``ASYNCFLOW_CPU_ACCOUNT`` names a directory; then every process that imports this
module keeps, per thread, the CPU nanoseconds (``time.thread_time_ns``) spent inside each
``span(component)`` and writes them to ``DIR/cpu_account-<pid>.json`` now and then (checked
when a span ends, so no thread is added and nothing wakes up on its own) and at exit.
``perf/cpu_account.py`` reads those files beside every thread's total CPU from /proc: a
thread's time outside any span goes to the component its thread name says.

Rules of a span:
- Exclusive: a span inside another takes its time out of the outer one (an RPC call's
  codec time is ``serialization``, the rest of the call ``rpc``).
- Synchronous code only: a span must not contain an ``await`` (the event loop would run
  other tasks inside it, and their CPU would land in it).
- Off, ``span`` returns one shared do-nothing context manager: what is left on the hot path
  is a global read and a call.

This module is the lowest layer of asyncflow (it imports nothing of it), so that the RPC
layer and the TransferQueue, beneath ``asyncflow.metrics``, can record spans too.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ENV = "ASYNCFLOW_CPU_ACCOUNT"
FILE_PREFIX = "cpu_account-"
DUMP_INTERVAL_S = 0.5  # how stale a file may be: the benchmark scales each file's change to its window

_OFF = nullcontext()


class _ThreadBook:
    """One thread's spans: the open ones (a stack) and the closed totals per component."""

    __slots__ = ("counts", "ident", "name", "stack", "totals")

    def __init__(self, name: str, ident: int):
        self.name, self.ident = name, ident
        self.stack: list[list[Any]] = []  # [component, start ns, ns of the spans inside]
        self.totals: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # events counted (a request served, by method)


class _Span:
    __slots__ = ("account", "component")

    def __init__(self, account: CpuAccount, component: str):
        self.account, self.component = account, component

    def __enter__(self) -> None:
        self.account._book().stack.append([self.component, time.thread_time_ns(), 0])

    def __exit__(self, *exc: object) -> None:
        end = time.thread_time_ns()
        book = self.account._book()
        component, start, inner = book.stack.pop()
        spent = end - start
        book.totals[component] = book.totals.get(component, 0) + spent - inner
        if book.stack:
            book.stack[-1][2] += spent
        self.account._maybe_dump()


class CpuAccount:
    """The per-thread books of one process and the file they are written to."""

    def __init__(self, out_dir: str, dump_interval_s: float = DUMP_INTERVAL_S):
        self.out_dir = out_dir
        self.dump_interval_s = dump_interval_s
        self.path = os.path.join(out_dir, f"{FILE_PREFIX}{os.getpid()}.json")
        self._local = threading.local()
        self._books: dict[int, _ThreadBook] = {}  # native thread id -> its book
        self._dump_lock = threading.Lock()
        self._next_dump = time.monotonic() + dump_interval_s

    def span(self, component: str) -> _Span:
        return _Span(self, component)

    def _book(self) -> _ThreadBook:
        book = getattr(self._local, "book", None)
        if book is None:
            book = self._local.book = _ThreadBook(threading.current_thread().name, threading.get_ident())
            self._books[threading.get_native_id()] = book
        return book

    def count(self, what: str) -> None:
        counts = self._book().counts
        counts[what] = counts.get(what, 0) + 1

    def current(self) -> str | None:
        """The innermost open span's component on this thread, or None."""
        stack = self._book().stack
        return stack[-1][0] if stack else None

    def snapshot(self) -> dict[str, Any]:
        """``{"pid", "time", "threads": {tid: name}, "cpu": {tid: ns}, "spans": {tid: {component: ns}},
        "counts": {what: n}}``: each Python thread's CPU clock and its spans read at one moment, the
        spans still open counted up to now (a long span, an update, is not left out of a window
        that ends inside it); every
        Python thread is named, spans or not (the OS knows Python's threads by the process's name)."""
        names = {t.native_id: _thread_name(t) for t in threading.enumerate() if t.native_id is not None}
        cpu = {t.native_id: _thread_cpu_ns(t.ident) for t in threading.enumerate() if t.native_id is not None}
        spans: dict[str, dict[str, int]] = {}
        counts: dict[str, int] = {}
        for tid, book in list(self._books.items()):
            names.setdefault(tid, book.name)
            totals = dict(book.totals)  # a C-level copy: atomic under the GIL
            now = cpu.get(tid)
            if now is not None:
                _add_open_spans(totals, [list(frame) for frame in list(book.stack)], now)
            spans[str(tid)] = totals
            for what, n in dict(book.counts).items():
                counts[what] = counts.get(what, 0) + n
        return {"pid": os.getpid(), "time": time.time(), "threads": {str(t): n for t, n in names.items()},
                "cpu": {str(t): ns for t, ns in cpu.items() if ns is not None}, "spans": spans, "counts": counts}

    def dump(self) -> None:
        """Write the snapshot (to a temporary file, then renamed: a reader never sees half)."""
        with self._dump_lock:
            os.makedirs(self.out_dir, exist_ok=True)
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, self.path)

    def _maybe_dump(self) -> None:
        now = time.monotonic()
        if now < self._next_dump or self._dump_lock.locked():
            return
        self._next_dump = now + self.dump_interval_s
        start = time.thread_time_ns()
        self.dump()
        spent = time.thread_time_ns() - start  # charged to "account", out of the open span's time
        book = self._book()
        book.totals["account"] = book.totals.get("account", 0) + spent
        if book.stack:
            book.stack[-1][2] += spent


def _thread_cpu_ns(ident: int | None) -> int | None:
    """CPU time of the thread ``ident`` of this process (any thread's, read from another), or None."""
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, TypeError):  # not POSIX, or the thread has ended
        return None


def _add_open_spans(totals: dict[str, int], stack: list[list[Any]], now: int) -> None:
    """Charge the open spans of a thread (outermost first: [component, start, ns inside]) with
    their exclusive CPU up to ``now``, as if each closed now."""
    end = now
    for component, start, inner in reversed(stack):
        spent = end - start - inner
        if spent > 0:
            totals[component] = totals.get(component, 0) + spent
        end = start  # the outer span's own time stops where this one began


def _thread_name(t: threading.Thread) -> str:
    """The thread's name; a default one (``Thread-3``) with what it runs, so it can be placed."""
    if not t.name.startswith("Thread-"):
        return t.name
    target = getattr(t, "_target", None)  # threading's own attribute: set while the thread runs
    what = type(t) if target is None else target  # else a subclass of Thread with its own run()
    return f"{t.name} ({getattr(what, '__module__', '?')}.{getattr(what, '__qualname__', '?')})"


def _from_env() -> CpuAccount | None:
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return None
    account = CpuAccount(out_dir)
    atexit.register(account.dump)
    return account


ACCOUNT: CpuAccount | None = _from_env()


def span(component: str) -> Any:
    """A context manager charging the CPU of its body on this thread to ``component``
    (nothing when the account is off)."""
    return _OFF if ACCOUNT is None else ACCOUNT.span(component)


def charged(component: str) -> Callable[[F], F]:
    """Decorator: the function's CPU goes to ``component``. Decided when the function is
    defined: with the account off the function is returned as it is (no cost at all). For
    plain functions only, never coroutines (see the rules above)."""
    def wrap(fn: F) -> F:
        account = ACCOUNT
        if account is None:
            return fn

        @functools.wraps(fn)
        def charged_fn(*args: Any, **kwargs: Any) -> Any:
            with account.span(component):
                return fn(*args, **kwargs)
        return charged_fn  # type: ignore[return-value]
    return wrap


def count(what: str) -> None:
    """Count one ``what`` on this thread (nothing when the account is off)."""
    if ACCOUNT is not None:
        ACCOUNT.count(what)


def enabled() -> bool:
    return ACCOUNT is not None
