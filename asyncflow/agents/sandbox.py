"""Run one function call in a fresh Python process with CPU-time and memory limits (Linux).

Every call starts its own process (``python -I <this file>``), so nothing one call does (a
changed global, a stray thread, a raised limit) reaches the next. The parent sends the call
by pickle on the child's stdin (parent to child only: the parent never unpickles what the
child sends); the child imports the function by module and qualified name, sets its limits,
calls it and answers with one JSON object: ``str()`` of the return value, or the exception
as "Type: message". The call's output is what the function returns; what the code prints
goes nowhere (the built-in ``run_python`` captures its own stdout and returns it).

Limits, set in the child after its imports and just before the call:

- CPU: RLIMIT_CPU soft limit at the CPU time used so far plus ``cpu_s`` (rounded up to whole
  seconds, as the kernel counts), hard limit one second later. Past the soft limit the kernel
  sends SIGXCPU, which ends the process; a handler that ignores it meets SIGKILL at the hard
  limit. Reported as status "timeout".
- Memory: RLIMIT_AS at the process's address space so far plus ``memory_mb``; an allocation
  past it raises MemoryError in the child, reported as status "error".
- Wall clock: past ``timeout_s`` the parent kills the child's whole process group (the child
  leads a new session, so programs it started die with it). Status "timeout".

The child runs in a fresh temporary directory (removed afterwards) with a minimal environment
(PATH, LANG, HOME and TMPDIR set to that directory): secrets in the parent's environment do
not reach sandboxed code. Its ``sys.path`` is the parent's. This file is also the child's
program, so it imports nothing of asyncflow at module level.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import math
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

__all__ = ["DEFAULT_MEMORY_MB", "SandboxOutcome", "check_sandboxable", "run_in_sandbox", "run_python"]

DEFAULT_MEMORY_MB = 1024
MAX_RESULT_BYTES = 16 * 2**20  # a child answering more than this is killed and reported as an error
_THIS_MODULE = "asyncflow.agents.sandbox"
_PROGRAM = os.path.abspath(__file__)


class SandboxOutcome(NamedTuple):
    """How one sandboxed call ended. ``value`` is ``str()`` of the return value, already cut to
    ``max_chars`` in the child; ``chars`` is its length before the cut."""

    status: Literal["ok", "error", "timeout"]
    value: str = ""
    chars: int = 0
    error: str | None = None
    returncode: int | None = None


def run_python(code: str) -> str:
    """Run ``code`` as a program with a fresh globals dict and return what it printed to stdout.

    The built-in "python" tool: it runs in the sandbox, never in the caller's process.
    ``sys.exit(0)`` (or ``sys.exit()``) ends the program normally; an uncaught exception, a
    non-zero exit included, is the call's error.
    """
    if not isinstance(code, str):
        raise TypeError(f"python: code must be a string, got {type(code).__name__}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})  # noqa: S102 - sandboxed
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
    return out.getvalue()


def check_sandboxable(fn: Callable[..., Any]) -> None:
    """Raise ValueError unless a fresh process can import ``fn`` by module and qualified name."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not qualname:
        raise ValueError(f"sandbox: {fn!r} is not a function with a module and a qualified name")
    if module == "__main__" or "<" in qualname:
        raise ValueError(
            f"sandbox: {module}.{qualname} cannot be imported by name in a fresh process; define a "
            f"sandboxed function at the top level of an importable module (not __main__, not a lambda "
            f"or a nested function)")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"sandbox: {module}.{qualname} is an async function; sandboxed tools must be plain functions")


async def run_in_sandbox(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float,
    cpu_s: float | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_chars: int | None = None,
) -> SandboxOutcome:
    """Call ``fn(*args, **kwargs)`` in a fresh limited process; never raises for what the call
    does (a TypeError for arguments that cannot be pickled, a ValueError for a function that
    cannot be imported by name). ``cpu_s`` defaults to ``timeout_s``."""
    import asyncio  # here, not at the top: the child (this file run as a program) has no use for it

    check_sandboxable(fn)
    cwd = os.getcwd()
    request = {
        "sys_path": [os.path.abspath(p) if p else cwd for p in sys.path],
        "module": fn.__module__, "qualname": fn.__qualname__,
        "args": tuple(args), "kwargs": dict(kwargs or {}),
        "cpu_s": float(cpu_s if cpu_s is not None else timeout_s), "memory_mb": int(memory_mb),
        "max_chars": max_chars,
    }
    try:
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # any pickling failure
        raise TypeError(f"sandbox: cannot send the arguments of {fn.__qualname__} to the sandbox: "
                        f"{type(e).__name__}: {e}") from e
    # Our own functions (run_python) need no site-packages, so they start without them (-S), faster.
    cmd = [sys.executable, "-I", *(["-S"] if fn.__module__ == _THIS_MODULE else []), _PROGRAM]
    with tempfile.TemporaryDirectory(prefix="asyncflow-sandbox-", ignore_cleanup_errors=True) as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=tmp, env=env, start_new_session=True)
        timed_out = too_large = False
        data = b""
        try:
            # (imported here: this file is also the child's program, which imports nothing of asyncflow)
            from asyncflow.rpc.waits import wait_within
            data = await wait_within(_exchange(proc, payload), timeout_s)
        except TimeoutError:
            timed_out = True
        except _TooLarge:
            too_large = True
        finally:
            _kill_group(proc.pid)  # the child is not reaped yet, so its pid (= group id) is still ours
            await proc.wait()
    rc = proc.returncode
    if timed_out:
        return SandboxOutcome("timeout", error=f"TimeoutError: no result within {timeout_s:g} s (wall clock); "
                                               f"the sandbox process was killed", returncode=rc)
    if too_large:
        return SandboxOutcome("error", error=f"sandbox answer exceeded {MAX_RESULT_BYTES} bytes", returncode=rc)
    answer = _parse(data)
    if answer is not None:
        return SandboxOutcome(answer["status"], answer.get("value", ""), answer.get("chars", 0),
                              answer.get("error"), rc)
    if rc == -signal.SIGXCPU:
        return SandboxOutcome("timeout", error=f"CPU time limit exceeded (cpu_s={request['cpu_s']:g}); "
                                               f"the sandbox process was killed", returncode=rc)
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        hint = " (its CPU hard limit, or the system ran out of memory)" if rc == -signal.SIGKILL else ""
        return SandboxOutcome("error", error=f"sandbox process died of {name}{hint}", returncode=rc)
    return SandboxOutcome("error", error=f"sandbox process exited with code {rc} without a result", returncode=rc)


class _TooLarge(Exception):
    pass


async def _exchange(proc: Any, payload: bytes) -> bytes:  # proc: asyncio.subprocess.Process
    try:
        proc.stdin.write(payload)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the child died early; its exit status says why
    finally:
        proc.stdin.close()
    chunks, size = [], 0
    while chunk := await proc.stdout.read(1 << 16):
        size += len(chunk)
        if size > MAX_RESULT_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    await proc.wait()
    return b"".join(chunks)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parse(data: bytes) -> dict[str, Any] | None:
    """The child's JSON answer, checked field by field (the sandboxed code could have written it)."""
    try:
        answer = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(answer, dict) or answer.get("status") not in ("ok", "error"):
        return None
    if answer["status"] == "ok":
        if not isinstance(answer.get("value"), str) or type(answer.get("chars")) is not int:
            return None
        return {"status": "ok", "value": answer["value"], "chars": answer["chars"]}
    if not isinstance(answer.get("error"), str):
        return None
    return {"status": "error", "error": answer["error"]}


# ---------------------------------------------------------------- the child (this file as a program)

def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    if module == _THIS_MODULE:  # ourselves, running as __main__
        obj: Any = sys.modules[__name__]
    else:
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _set_limits(cpu_s: float, memory_mb: int) -> None:
    import resource  # POSIX only, as the limits it sets

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = max(1, math.ceil(usage.ru_utime + usage.ru_stime + cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    limit = size + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _child_main() -> None:
    answer_fd = os.dup(1)  # the answer's channel; fd 1 itself goes to /dev/null so stray writes cannot mix in
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    memory_mb = None
    try:
        req = pickle.loads(sys.stdin.buffer.read())
        sys.path[:] = req["sys_path"]
        memory_mb = req["memory_mb"]
        fn = _resolve(req["module"], req["qualname"])
        _set_limits(req["cpu_s"], memory_mb)
        value = fn(*req["args"], **req["kwargs"])
        text = value if isinstance(value, str) else str(value)
        max_chars = req["max_chars"]
        answer = {"status": "ok", "value": text if max_chars is None else text[:max_chars], "chars": len(text)}
    except MemoryError as e:
        answer = {"status": "error", "error": f"{_describe(e)} (sandbox memory limit: {memory_mb} MB)"}
    except BaseException as e:  # noqa: BLE001 - every failure is the call's answer
        answer = {"status": "error", "error": _describe(e)}
    data = json.dumps(answer).encode()
    while data:
        data = data[os.write(answer_fd, data):]
    os._exit(0)  # no atexit handlers, no waiting for threads the call left running


if __name__ == "__main__":
    _child_main()
