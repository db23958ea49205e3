"""Tools: the registry, calls with timeouts and on_error policies, truncation, per-tool stats,
the hung-thread cap, the subprocess sandbox (CPU, memory and wall-clock limits) and the
built-in calculator and python tools."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import _sandbox_tools
import pytest

from asyncflow.agents import tools as T
from asyncflow.agents.sandbox import run_python
from asyncflow.agents.tools import (
    TOOL_STATS,
    TOOLS,
    TRUNCATION_MARKER,
    ToolError,
    UnknownToolError,
    calculate,
    call_tool,
    get_tool,
    num_hung_threads,
    register_tool,
    tool_names,
    unregister_tool,
)


@pytest.fixture
def tool():
    """Register tools for one test; they are removed afterwards."""
    names = []

    def register(name, fn, **opts):
        register_tool(name, **opts)(fn)
        names.append(name)
        return name

    yield register
    for name in names:
        TOOLS.pop(name, None)


def run(coro):
    return asyncio.run(coro)


def _wait_until(cond, timeout=30.0):
    """Poll ``cond`` until true; ``timeout`` only bounds a broken test's hang."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


# ---------------------------------------------------------------- calculator

@pytest.mark.parametrize("expr, want", [
    ("1+2*3", "7"), ("(1+2)*3", "9"), ("-4/2", "-2"), ("7/2", "3.5"), ("0.1+0.2", "0.3"), ("2*-3", "-6"),
    ("1.5*2", "3"), ("10/4", "2.5"), ("1/3", "0.3333333333333333"), ("-(2-5)", "3"), (" 12 ", "12"),
    ("123456789123456789*1000", "123456789123456789000"), ("-0.5", "-0.5"), ("0*-1", "0"),
])
def test_calculator_is_exact(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("expr, why", [
    ("__import__('os')", "function call not allowed"), ("2**10", "operator \\*\\* not allowed"),
    ("x+1", "name not allowed"), ("'a'*3", "not a number"), ("True+1", "not a number"),
    ("7//2", "operator // not allowed"), ("1 < 2", "comparison not allowed"), ("", "not an arithmetic expression"),
    ("1+", "not an arithmetic expression"), ("().__class__", "attribute not allowed"), ("1e999", "out of range"),
    ("1" * 2000, "at most 1000"),
])
def test_calculator_refuses_what_is_not_arithmetic(expr, why):
    with pytest.raises(ValueError, match=why):
        calculate(expr)


def test_calculator_as_a_tool():
    ok = run(call_tool("calculator", "6*7"))
    assert (ok.text, ok.ok, ok.status, ok.error, ok.end_episode) == ("42", True, "ok", None, False)
    bad = run(call_tool("calculator", "__import__('os').system('true')"))
    assert not bad.ok and bad.status == "error"
    assert bad.text.startswith("error: ValueError: calculator: function call not allowed")
    zero = run(call_tool("calculator", "1/(2-2)"))
    assert zero.text == "error: ZeroDivisionError: division by zero"
    assert zero.error == "ZeroDivisionError: division by zero"


# ---------------------------------------------------------------- registry

def test_unknown_tool_lists_the_registered_ones():
    with pytest.raises(UnknownToolError, match=r"unknown tool 'nope'; registered: .*calculator.*python"):
        run(call_tool("nope", 1))
    with pytest.raises(ValueError):  # UnknownToolError is a ValueError
        get_tool("nope")
    assert {"calculator", "python"} <= set(tool_names())


def test_registering_a_name_twice_is_refused(tool):
    def first():
        return "1"

    def second():
        return "2"

    tool("t_twice", first)
    with pytest.raises(ValueError, match="'t_twice' is already registered to .*first"):
        register_tool("t_twice")(second)
    with pytest.raises(ValueError, match="already registered"):  # lambdas share a qualified name
        register_tool("t_twice_lambda")(lambda: 1)
        register_tool("t_twice_lambda")(lambda: 2)
    TOOLS.pop("t_twice_lambda", None)
    register_tool("t_twice")(first)  # the same function again (a module reload) is fine
    register_tool("t_twice", overwrite=True)(second)
    assert run(call_tool("t_twice")).text == "2"
    unregister_tool("t_twice")
    assert "t_twice" not in tool_names()


@pytest.mark.parametrize("opts, why", [
    ({"timeout_s": 0}, "timeout_s"), ({"max_output_chars": 0}, "max_output_chars"),
    ({"on_error": "ignore"}, "on_error"),
    ({"cpu_s": 1.0}, "sandboxed tools only"), ({"memory_mb": 10}, "sandboxed tools only"),
    ({"sandbox": True, "memory_mb": -1}, "memory_mb"),
])
def test_bad_options_are_refused(opts, why):
    with pytest.raises(ValueError, match=why):
        register_tool("t_bad", **opts)
    assert "t_bad" not in TOOLS


def test_a_sandboxed_tool_must_be_importable_by_name():
    def local(x):
        return x

    with pytest.raises(ValueError, match="cannot be imported by name"):
        register_tool("t_local", sandbox=True)(local)
    with pytest.raises(ValueError, match="cannot be imported by name"):
        register_tool("t_lambda", sandbox=True)(lambda: 0)
    assert "t_local" not in TOOLS and "t_lambda" not in TOOLS


# ---------------------------------------------------------------- thread tools: policies, timeouts

def test_return_values_become_text(tool):
    tool("t_int", lambda: 42)
    tool("t_none", lambda: None)
    tool("t_args", lambda a, b=0, *, c="": f"{a}-{b}-{c}")
    assert run(call_tool("t_int")).text == "42"
    assert run(call_tool("t_none")).text == "None"
    assert run(call_tool("t_args", 1, 2, c="x")).text == "1-2-x"


def test_raise_under_the_message_policy_is_the_tool_output(tool):
    def boom():
        raise RuntimeError("disk on fire")

    tool("t_boom", boom)
    r = run(call_tool("t_boom"))
    assert (r.ok, r.status, r.text, r.error, r.end_episode) == (
        False, "error", "error: RuntimeError: disk on fire", "RuntimeError: disk on fire", False)


def test_end_policy_ends_the_episode(tool):
    def boom():
        raise KeyError("k")

    tool("t_end", boom, on_error="end")
    r = run(call_tool("t_end"))
    assert r.end_episode and not r.ok and r.text == "error: KeyError: 'k'"
    tool("t_end_ok", lambda: "fine", on_error="end")
    assert not run(call_tool("t_end_ok")).end_episode


def test_raise_policy_raises_tool_error(tool):
    tool("t_raise", lambda: 1 / 0, on_error="raise")
    with pytest.raises(ToolError, match="tool 't_raise' failed: ZeroDivisionError") as info:
        run(call_tool("t_raise"))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_long_output_is_truncated_with_a_marker(tool):
    tool("t_long", lambda n: "x" * n, max_output_chars=100)
    r = run(call_tool("t_long", 1000))
    assert r.status == "truncated" and r.ok and r.text == "x" * 100 + TRUNCATION_MARKER
    assert run(call_tool("t_long", 100)).text == "x" * 100  # exactly the limit: kept whole
    tool("t_long_error", lambda: (_ for _ in ()).throw(ValueError("y" * 500)), max_output_chars=50)
    r = run(call_tool("t_long_error"))
    assert r.status == "error" and r.text == ("error: ValueError: " + "y" * 500)[:50] + TRUNCATION_MARKER


def test_timeout_returns_on_time_without_blocking_the_loop(tool):
    entered, release = threading.Event(), threading.Event()
    tool("t_hang", lambda: entered.set() or release.wait(30), timeout_s=0.3)

    async def main():
        call = asyncio.create_task(call_tool("t_hang"))
        # The loop runs this coroutine while the tool hangs in its thread: it is not blocked.
        assert await asyncio.to_thread(entered.wait, 30)
        assert not call.done()
        result = await call
        assert not release.is_set() and num_hung_threads() == 1  # back while the tool still ran
        return result

    try:
        r = run(main())
    finally:
        release.set()
    assert r.status == "timeout" and not r.ok and not r.end_episode
    assert r.text == "error: TimeoutError: tool 't_hang' did not return within 0.3 s"
    assert r.seconds >= 0.3 - 1e-3  # a reported duration: the call gave the tool its whole timeout
    assert _wait_until(lambda: num_hung_threads() == 0)


def test_ten_concurrent_calls_run_in_parallel(tool):
    together = threading.Barrier(10)  # passed only when all ten calls are running at once
    tool("t_meet", lambda i: (together.wait(20), i)[1], timeout_s=30.0)

    async def main():
        return await asyncio.gather(*(call_tool("t_meet", i) for i in range(10)))

    results = run(main())
    assert [(r.status, r.text) for r in results] == [("ok", str(i)) for i in range(10)]


def test_hung_threads_are_capped(tool, monkeypatch):
    assert _wait_until(lambda: num_hung_threads() == 0)
    release = threading.Event()
    tool("t_stuck", lambda: release.wait(10), timeout_s=0.05)
    monkeypatch.setattr(T, "MAX_HUNG_THREADS", 1)

    async def main():
        assert (await call_tool("t_stuck")).status == "timeout"  # 1 hung: at the cap
        with pytest.raises(ToolError, match="2 tool calls are still running past their timeouts"):
            await call_tool("t_stuck")  # 2 hung: past it, the call times out and raises
        with pytest.raises(ToolError, match="MAX_HUNG_THREADS=1"):
            await call_tool("calculator", "1+1")  # refused before it starts a thread
        assert (await call_tool("python", "print(3)")).text == "3\n"  # the sandbox starts no thread

    try:
        run(main())
    finally:
        release.set()
    assert _wait_until(lambda: num_hung_threads() == 0)
    assert run(call_tool("calculator", "1+1")).text == "2"


def test_async_tools_run_on_the_loop_and_are_cancelled_on_timeout(tool):
    cancelled = []

    async def slow(x):
        try:
            await asyncio.sleep(x)
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return f"slept {x}"

    async def broken():
        raise ValueError("bad")

    tool("t_async", slow, timeout_s=0.2)
    tool("t_async_broken", broken)
    assert run(call_tool("t_async", 0.01)).text == "slept 0.01"
    r = run(call_tool("t_async", 5))
    assert r.status == "timeout" and cancelled == [5]
    assert run(call_tool("t_async_broken")).text == "error: ValueError: bad"


def test_stats_count_per_tool(tool):
    tool("t_stat", lambda mode: {"ok": "a", "long": "b" * 50}.get(mode) or 1 / 0, max_output_chars=10)
    tool("t_stat_slow", lambda: time.sleep(0.3), timeout_s=0.05)

    async def main():
        for mode in ("ok", "ok", "long", "bad"):
            await call_tool("t_stat", mode)
        await call_tool("t_stat_slow")

    run(main())
    snap = TOOL_STATS.snapshot()
    assert {k: snap["t_stat"][k] for k in ("calls", "errors", "timeouts", "truncations")} == {
        "calls": 4, "errors": 1, "timeouts": 0, "truncations": 1}
    assert {k: snap["t_stat_slow"][k] for k in ("calls", "errors", "timeouts", "truncations")} == {
        "calls": 1, "errors": 1, "timeouts": 1, "truncations": 0}
    assert snap["t_stat_slow"]["seconds"] >= 0.05
    totals = TOOL_STATS.totals()
    assert totals["calls"] >= 5 and totals["timeouts"] >= 1
    assert _wait_until(lambda: num_hung_threads() == 0)


# ---------------------------------------------------------------- sandbox and the python tool

def test_python_tool_returns_stdout_with_fresh_globals():
    r = run(call_tool("python", "x = 6 * 7\nprint(x)\nprint('hi')"))
    assert (r.status, r.text) == ("ok", "42\nhi\n")
    r = run(call_tool("python", "print(x)"))  # the last call's x is gone
    assert r.status == "error" and r.text == "error: NameError: name 'x' is not defined"
    assert run(call_tool("python", "print('a')\nimport sys\nsys.exit(0)\nprint('b')")).text == "a\n"
    assert run(call_tool("python", "import sys; sys.exit(3)")).text == "error: SystemExit: 3"
    assert run(call_tool("python", "def f(:")).text.startswith("error: SyntaxError")
    assert run(call_tool("python", "")).text == ""


def test_python_tool_truncates_in_the_sandbox():
    r = run(call_tool("python", "print('z' * 100000)"))
    assert r.status == "truncated" and r.text == "z" * 4096 + TRUNCATION_MARKER


def test_sandbox_cpu_limit_kills_an_infinite_loop(tool):
    # The wall-clock limit is far above the CPU limit, so a loaded machine cannot make the
    # wall clock end the loop first; the message tells which limit did.
    tool("t_py_cpu", run_python, sandbox=True, timeout_s=120.0, cpu_s=0.5)
    r = run(call_tool("t_py_cpu", "while True:\n    pass"))
    assert r.status == "timeout" and not r.ok
    assert r.text.startswith("error: CPU time limit exceeded (cpu_s=0.5)")


def test_sandbox_memory_limit_fails_cleanly():
    r = run(call_tool("python", "x = bytearray(2 * 1024**3)\nprint(len(x))"))
    assert r.status == "error" and r.text == "error: MemoryError (sandbox memory limit: 1024 MB)"
    assert run(call_tool("python", "x = bytearray(100 * 1024**2)\nprint(len(x))")).text == f"{100 * 1024**2}\n"


def test_sandbox_wall_timeout_kills_the_process_group(tool, tmp_path):
    # The limit leaves a loaded machine ample time to start the sandbox and its child (the
    # limit counts from the sandbox's start); the code then sleeps far past it.
    tool("t_py_wall", run_python, sandbox=True, timeout_s=3.0)
    pidfile = tmp_path / "pid"
    code = (f"import subprocess, time\np = subprocess.Popen(['sleep', '60'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(60)")
    r = run(call_tool("t_py_wall", code))
    assert r.status == "timeout" and "no result within 3 s (wall clock)" in r.text
    assert pidfile.read_text(), "the sandbox did not start its child within the limit"
    pid = int(pidfile.read_text())

    def gone():
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # killed, not yet reaped by init
        except FileNotFoundError:
            return True

    assert _wait_until(gone), "the sandbox's own child process survived the timeout"


def test_sandbox_runs_user_module_tools_with_limits(tool):
    tool("t_add", _sandbox_tools.add, sandbox=True, timeout_s=10.0)
    tool("t_limits", _sandbox_tools.pid_and_limits, sandbox=True, timeout_s=10.0, cpu_s=3.0, memory_mb=256)
    assert run(call_tool("t_add", 2, b=3)).text == "5"  # ints back as text
    assert run(call_tool("t_add", "a", b="b")).text == "ab"
    pid, cpu, address_space = run(call_tool("t_limits")).text.split()
    assert int(pid) != os.getpid()
    assert 3 <= int(cpu) <= 5 and 256 * 2**20 < int(address_space) < 2**40


def test_sandbox_hides_the_environment_and_the_working_directory(monkeypatch):
    monkeypatch.setenv("ASYNCFLOW_TEST_SECRET", "hunter2")
    r = run(call_tool("python", "import os\nprint(os.environ.get('ASYNCFLOW_TEST_SECRET'))\nprint(os.getcwd())"))
    secret, cwd = r.text.splitlines()
    assert secret == "None"
    assert cwd != os.getcwd() and "asyncflow-sandbox-" in cwd and not os.path.exists(cwd)  # removed after the call


def test_sandbox_calls_run_concurrently(tool, tmp_path):
    """Four sandboxed calls meet at a barrier of files: each marks that it started, then waits
    until all four have; calls that ran one after another would never all meet."""
    tool("t_py_meet", run_python, sandbox=True, timeout_s=60.0)
    code = ("import os, time\n"
            f"d = {str(tmp_path)!r}\n"
            "open(os.path.join(d, 'started-{i}'), 'w').close()\n"
            "end = time.monotonic() + 30\n"
            "while len([n for n in os.listdir(d) if n.startswith('started-')]) < 4:\n"
            "    if time.monotonic() > end:\n"
            "        raise SystemExit('alone')\n"
            "    time.sleep(0.01)\n"
            "print({i})")

    async def main():
        return await asyncio.gather(*(call_tool("t_py_meet", code.replace("{i}", str(i))) for i in range(4)))

    results = run(main())
    assert [r.text for r in results] == [f"{i}\n" for i in range(4)]


def test_sandbox_refuses_unpicklable_arguments():
    with pytest.raises(TypeError, match="cannot send the arguments"):
        run(call_tool("python", threading.Lock()))


def test_a_cancelled_sandbox_call_kills_its_process(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"

    async def main():
        call = asyncio.create_task(call_tool("python", code))
        # The file exists before its pid is written (open, then write and close): wait for the
        # pid itself, or a cancellation in between leaves it empty.
        assert await asyncio.to_thread(_wait_until, lambda: pidfile.exists() and pidfile.read_text() != "")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    run(main())
    pid = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped before the cancellation returned
