"""Tools for multi-turn episodes: plain Python functions registered by name, called with a timeout.

An episode awaits ``call_tool(name, *args, **kwargs)`` and gets a ``ToolResult`` whose ``text``
goes back into the conversation. A call never blocks the event loop: a plain function runs in a
daemon thread of its own, an ``async def`` tool runs on the loop, a ``sandbox=True`` tool runs
in a fresh subprocess with CPU-time and memory limits (``asyncflow.agents.sandbox``). User
modules register their tools with ``@register_tool(...)``; list the module in the config's
``imports`` so that every worker imports it.

What a failed call becomes (it raised, passed ``timeout_s``, or hit a sandbox limit) is the
tool's ``on_error`` policy:

- "message": the error is the output the model sees, e.g. "error: ZeroDivisionError: division
  by zero" (status "error", or "timeout");
- "end": the same text, and ``result.end_episode`` is True: the episode must end;
- "raise": ``ToolError`` is raised to the episode code.

Whatever the policy, an output longer than ``max_output_chars`` keeps its first
``max_output_chars`` characters followed by ``TRUNCATION_MARKER`` (status "truncated", still
ok), and a return value that is not a string is converted with ``str()``.

A Python thread cannot be killed: a plain tool that passes its timeout is abandoned, its
thread left running in the background (a daemon, it does not keep the process alive). While
more than ``MAX_HUNG_THREADS`` abandoned calls are still running, thread tool calls raise
ToolError instead of leaking more threads (the call that crosses the cap times out and
raises). A tool that can truly hang belongs in the sandbox, where a timeout kills it.

Every call is counted per tool in ``TOOL_STATS`` (calls, errors, timeouts, truncations,
seconds); ``TOOL_STATS.snapshot()`` reads them.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any, Literal

from ..rpc.waits import wait_within
from .sandbox import DEFAULT_MEMORY_MB, check_sandboxable, run_in_sandbox, run_python

__all__ = [
    "MAX_HUNG_THREADS", "TOOLS", "TOOL_STATS", "TRUNCATION_MARKER", "ToolError", "ToolResult", "ToolSpec",
    "ToolStats", "UnknownToolError", "calculate", "call_tool", "get_tool", "num_hung_threads", "register_tool",
    "tool_names", "unregister_tool",
]

OnError = Literal["message", "end", "raise"]
ToolStatus = Literal["ok", "error", "timeout", "truncated"]
ON_ERROR = ("message", "end", "raise")
TRUNCATION_MARKER = "...[truncated]"
MAX_HUNG_THREADS = 8


class ToolError(RuntimeError):
    """A tool call failed under on_error="raise", or too many timed-out calls are still running."""


class UnknownToolError(ValueError):
    """No tool is registered under the given name."""


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool: the function and how to call it (see ``register_tool``)."""

    name: str
    fn: Callable[..., Any]
    timeout_s: float
    max_output_chars: int | None
    on_error: OnError
    sandbox: bool
    cpu_s: float | None  # sandbox only
    memory_mb: int | None  # sandbox only


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome. ``text`` is what goes into the conversation: the output (cut and
    marked if too long) or, for a failed call, "error: <what happened>"."""

    name: str
    text: str
    status: ToolStatus
    error: str | None = None
    seconds: float = 0.0
    end_episode: bool = False

    @property
    def ok(self) -> bool:
        """The tool returned (its output possibly truncated); False for an error or a timeout."""
        return self.status in ("ok", "truncated")


TOOLS: dict[str, ToolSpec] = {}


def register_tool(
    name: str,
    *,
    timeout_s: float = 10.0,
    max_output_chars: int | None = 4096,
    on_error: OnError = "message",
    sandbox: bool = False,
    cpu_s: float | None = None,
    memory_mb: int | None = None,
    overwrite: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as the tool ``name``; returns ``fn`` unchanged.

    ``timeout_s``: wall-clock limit of a call (a sandboxed call's includes starting its
    process). ``max_output_chars``: longer outputs are truncated (None: never). ``on_error``:
    "message", "end" or "raise" (module docstring). ``sandbox``: run each call in a fresh
    subprocess limited to ``cpu_s`` seconds of CPU (default ``timeout_s``) and ``memory_mb``
    MB of address space beyond its size after start-up (default 1024); the function must be
    a top-level function of an importable module. A taken name is refused unless ``overwrite``
    or it is the same function again (same module and qualified name, as after a reload).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_tool: name must be a non-empty string, got {name!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"register_tool({name!r}): timeout_s must be a positive number, got {timeout_s!r}")
    if max_output_chars is not None and not (type(max_output_chars) is int and max_output_chars > 0):
        raise ValueError(f"register_tool({name!r}): max_output_chars must be a positive int or None, "
                         f"got {max_output_chars!r}")
    if on_error not in ON_ERROR:
        raise ValueError(f"register_tool({name!r}): on_error {on_error!r}; expected one of {', '.join(ON_ERROR)}")
    if not sandbox and (cpu_s is not None or memory_mb is not None):
        raise ValueError(f"register_tool({name!r}): cpu_s and memory_mb limit sandboxed tools only; "
                         f"pass sandbox=True or drop them")
    if cpu_s is not None and not (isinstance(cpu_s, (int, float)) and math.isfinite(cpu_s) and cpu_s > 0):
        raise ValueError(f"register_tool({name!r}): cpu_s must be a positive number, got {cpu_s!r}")
    if memory_mb is not None and not (type(memory_mb) is int and memory_mb > 0):
        raise ValueError(f"register_tool({name!r}): memory_mb must be a positive int, got {memory_mb!r}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"register_tool({name!r}): {fn!r} is not callable")
        if sandbox:
            check_sandboxable(fn)
        old = TOOLS.get(name)
        if old is not None and old.fn is not fn and not overwrite and not _same_function(old.fn, fn):
            raise ValueError(f"register_tool: {name!r} is already registered to {_ident(old.fn)}; "
                             f"pick another name or pass overwrite=True")
        TOOLS[name] = ToolSpec(
            name=name, fn=fn, timeout_s=float(timeout_s), max_output_chars=max_output_chars, on_error=on_error,
            sandbox=bool(sandbox), cpu_s=(float(cpu_s) if cpu_s is not None else float(timeout_s)) if sandbox else None,
            memory_mb=(memory_mb or DEFAULT_MEMORY_MB) if sandbox else None)
        return fn

    return decorator


def _ident(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """The same top-level function, as after a module reload (nested functions and lambdas
    share qualified names, so those must be the very same object)."""
    return _ident(a) == _ident(b) and "<" not in _ident(a)


def get_tool(name: str) -> ToolSpec:
    """The tool registered as ``name``; UnknownToolError (a ValueError) listing the tools otherwise."""
    try:
        return TOOLS[name]
    except (KeyError, TypeError):
        raise UnknownToolError(
            f"unknown tool {name!r}; registered: {', '.join(tool_names()) or '(none)'}. Register yours with "
            f"@asyncflow.agents.register_tool(...) in a module listed in the config's imports") from None


def tool_names() -> list[str]:
    """Registered tool names, sorted."""
    return sorted(TOOLS)


def unregister_tool(name: str) -> None:
    """Remove a tool (UnknownToolError if there is none)."""
    get_tool(name)
    del TOOLS[name]


# ---------------------------------------------------------------- statistics

class ToolStats:
    """Per-tool counters: calls, errors (every call that is not ok, timeouts included),
    timeouts, truncations, and the calls' wall-clock seconds. Thread-safe."""

    FIELDS = ("calls", "errors", "timeouts", "truncations", "seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tool: dict[str, dict[str, float]] = {}

    def record(self, result: ToolResult) -> None:
        with self._lock:
            row = self._by_tool.setdefault(result.name, {k: 0 if k != "seconds" else 0.0 for k in self.FIELDS})
            row["calls"] += 1
            row["errors"] += not result.ok
            row["timeouts"] += result.status == "timeout"
            row["truncations"] += result.status == "truncated"
            row["seconds"] += result.seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{tool name: {field: value}}, a copy."""
        with self._lock:
            return {name: dict(row) for name, row in self._by_tool.items()}

    def totals(self) -> dict[str, float]:
        """Each field summed over the tools."""
        snap = self.snapshot()
        return {k: sum(row[k] for row in snap.values()) for k in self.FIELDS}

    def reset(self) -> None:
        with self._lock:
            self._by_tool.clear()


TOOL_STATS = ToolStats()


# ---------------------------------------------------------------- calling

_hung: list[threading.Thread] = []
_hung_lock = threading.Lock()


def num_hung_threads() -> int:
    """Thread tool calls abandoned past their timeout that are still running."""
    with _hung_lock:
        _hung[:] = [t for t in _hung if t.is_alive()]
        return len(_hung)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _too_many_hung(name: str) -> ToolError:
    return ToolError(
        f"tool {name!r}: {num_hung_threads()} tool calls are still running past their timeouts "
        f"(MAX_HUNG_THREADS={MAX_HUNG_THREADS}); threads cannot be killed, so thread tool calls stop rather "
        f"than leak more. Fix the tool, raise its timeout_s, or register it with sandbox=True.")


# (status "ok"|"error"|"timeout", output or error text, the exception if any)
_Outcome = tuple[Literal["ok", "error", "timeout"], str, "BaseException | None"]  # a call before its output is cut


async def _call_in_thread(spec: ToolSpec, args: tuple, kwargs: dict) -> _Outcome:
    import asyncio  # here and below, not at the top: a sandboxed tool's module imports this module
    # in a fresh process for every call, and importing asyncio would be most of that import's time
    if num_hung_threads() > MAX_HUNG_THREADS:
        raise _too_many_hung(spec.name)
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def deliver(outcome: _Outcome) -> None:
        if not done.done():  # cancelled when the caller stopped waiting
            done.set_result(outcome)

    def target() -> None:
        try:
            value = spec.fn(*args, **kwargs)
            outcome: _Outcome = ("ok", value if isinstance(value, str) else str(value), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whose policy decides
            outcome = ("error", _describe(exc), exc)
        try:
            loop.call_soon_threadsafe(deliver, outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    thread = threading.Thread(target=target, name=f"tool-{spec.name}", daemon=True)
    thread.start()
    try:
        return await wait_within(done, spec.timeout_s)
    except TimeoutError:
        with _hung_lock:
            _hung.append(thread)
        return ("timeout", f"TimeoutError: tool {spec.name!r} did not return within {spec.timeout_s:g} s", None)


async def _call_async(spec: ToolSpec, args: tuple, kwargs: dict) -> _Outcome:
    task = asyncio.ensure_future(spec.fn(*args, **kwargs))
    try:
        finished, _ = await asyncio.wait({task}, timeout=spec.timeout_s)
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it now
    if not finished:
        return ("timeout", f"TimeoutError: tool {spec.name!r} did not return within {spec.timeout_s:g} s", None)
    if task.cancelled():
        return ("error", "CancelledError: the tool's task was cancelled", None)
    exc = task.exception()
    if exc is not None:
        return ("error", _describe(exc), exc)
    try:
        value = task.result()
        return ("ok", value if isinstance(value, str) else str(value), None)
    except Exception as e:  # noqa: BLE001 - str() of the value raised
        return ("error", _describe(e), e)


def _cut(text: str, max_chars: int | None, chars: int | None = None) -> tuple[str, bool]:
    """``text`` limited to ``max_chars`` plus the marker; ``chars``: its full length if longer than ``text``."""
    full = len(text) if chars is None else max(chars, len(text))
    if max_chars is None or full <= max_chars:
        return text, False
    return text[:max_chars] + TRUNCATION_MARKER, True


async def call_tool(name: str, /, *args: Any, **kwargs: Any) -> ToolResult:
    """Call the tool ``name`` with these arguments, within its timeout, without blocking the
    event loop; its policy decides what a failure becomes (module docstring).

    Raises UnknownToolError for a name nobody registered, ToolError under on_error="raise" or
    past the cap on hung threads, TypeError if a sandboxed call's arguments cannot be pickled.
    """
    spec = get_tool(name)
    start = time.perf_counter()
    chars = None
    if spec.sandbox:
        out = await run_in_sandbox(spec.fn, args, kwargs, timeout_s=spec.timeout_s, cpu_s=spec.cpu_s,
                                   memory_mb=spec.memory_mb or DEFAULT_MEMORY_MB, max_chars=spec.max_output_chars)
        status, text, cause = out.status, (out.value if out.status == "ok" else out.error or ""), None
        chars = out.chars if out.status == "ok" else None
    elif inspect.iscoroutinefunction(spec.fn):
        status, text, cause = await _call_async(spec, args, kwargs)
    else:
        status, text, cause = await _call_in_thread(spec, args, kwargs)
    seconds = time.perf_counter() - start
    if status == "ok":
        text, truncated = _cut(text, spec.max_output_chars, chars)
        result = ToolResult(name, text, "truncated" if truncated else "ok", None, seconds)
    else:
        shown, _ = _cut(f"error: {text}", spec.max_output_chars)
        result = ToolResult(name, shown, status, text, seconds, end_episode=spec.on_error == "end")
    TOOL_STATS.record(result)
    if status == "timeout" and not spec.sandbox and num_hung_threads() > MAX_HUNG_THREADS:
        raise _too_many_hung(name)
    if not result.ok and spec.on_error == "raise":
        raise ToolError(f"tool {name!r} failed: {text}") from cause
    return result


# ---------------------------------------------------------------- built-in tools

MAX_EXPRESSION_CHARS = 1000
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
              ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitXor: "^",
              ast.BitAnd: "&", ast.MatMult: "@"}
_KINDS = {ast.Call: "function call", ast.Name: "name", ast.Attribute: "attribute", ast.Subscript: "subscript",
          ast.Compare: "comparison", ast.BoolOp: "boolean operator", ast.Lambda: "lambda"}


@register_tool("calculator", timeout_s=2.0, max_output_chars=200)
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers and decimals with + - * / ( ) and unary
    minus, exactly (as fractions); an integer result is written without ".0", any other as the
    nearest float. ValueError says what is not allowed; division by zero raises ZeroDivisionError."""
    if not isinstance(expression, str):
        raise ValueError(f"calculator: expected an expression string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calculator: expression of {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"calculator: not an arithmetic expression: {expression!r} ({e.msg})") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ValueError("calculator: expression nested too deeply") from None
    return _format_number(value)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        v = node.value
        if type(v) is int:
            return Fraction(v)
        if type(v) is float:
            if not math.isfinite(v):
                raise ValueError(f"calculator: number out of range: {ast.unparse(node)}")
            return Fraction(repr(v))  # the decimal as written (0.1 is 1/10), not its binary float
        raise ValueError(f"calculator: not a number: {v!r}; only numbers, + - * / and parentheses are allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _evaluate(node.operand)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return a / b
    if isinstance(node, ast.BinOp):
        what = f"operator {_OPERATORS.get(type(node.op), type(node.op).__name__)}"
    elif isinstance(node, ast.UnaryOp):
        what = f"unary operator {type(node.op).__name__}"
    else:
        what = _KINDS.get(type(node), type(node).__name__)
    snippet = ast.unparse(node)
    snippet = snippet if len(snippet) <= 60 else snippet[:57] + "..."
    raise ValueError(f"calculator: {what} not allowed: {snippet!r}; only numbers, + - * / and parentheses are allowed")


def _format_number(value: Fraction) -> str:
    if value.denominator == 1:
        try:
            return str(value.numerator)
        except ValueError:  # more digits than int -> str allows
            pass
    else:
        try:
            f = float(value)
            if f != 0.0:
                return repr(f)
        except OverflowError:
            pass
    with localcontext() as ctx:  # too large or too small for a float, or too long to write out
        ctx.prec = 17
        return str(Decimal(value.numerator) / Decimal(value.denominator))


register_tool("python", sandbox=True, timeout_s=10.0, max_output_chars=4096)(run_python)
