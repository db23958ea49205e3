"""Agents in a process of their own (``rollout.openai_endpoint.agent_process``).

In the rollout instance's process the agents' own Python (the ``openai`` client builds and
parses every request), the endpoint and the engine's service thread take turns on one
interpreter lock; while the agents run, the engine waits for their next requests and decodes
smaller batches. An ``AgentHost`` runs the agents in a child process instead (spawned, with
an event loop: async agents on it, sync agents on threads of their own), on another core.
Only the call crosses: ``(path, row, base_url, api_key)`` in, the reward or the error out;
keys, recording and the trajectory stay with the instance. An agent cancelled in the
instance (its time limit) is cancelled in the child.
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["AgentHost"]


class AgentHost:
    def __init__(self, name: str = "agents", start_timeout_s: float = 120.0) -> None:
        # a fresh interpreter (not a fork: no copy of the instance's threads and engine; not
        # multiprocessing's spawn, which would import the instance's main module again), on its end
        # of a socket pair, with the instance's import path
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._conn = Connection(mine.detach())
        if not self._conn.poll(start_timeout_s) or self._conn.recv() != "ready":
            self._proc.kill()
            raise RuntimeError(f"{name}: the agent process did not start within {start_timeout_s:.0f} s "
                               f"(exit code {self._proc.poll()})")
        self.pid = self._proc.pid
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-agents-reader", daemon=True)
        self._reader.start()

    def run(self, path: str, row: dict, base_url: str, api_key: str) -> asyncio.Future:
        """The agent ``path`` on this row in the child; a future of its reward (on the running loop).
        Cancelling the future cancels the agent there."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        cid = next(self._ids)
        self._pending[cid] = (loop, fut)
        self._send(("run", cid, path, row, base_url, api_key))
        fut.add_done_callback(lambda f: self._send(("cancel", cid)) if f.cancelled() else None)
        return fut

    def _send(self, msg: tuple) -> None:
        if self._closed:
            return
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, EOFError):
                pass  # the child is gone: the reader fails what is pending

    def _read(self) -> None:
        while True:
            try:
                cid, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            loop, fut = self._pending.pop(cid, (None, None))
            if loop is not None and fut is not None:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
        code = self._proc.poll()
        for loop, fut in list(self._pending.values()):
            loop.call_soon_threadsafe(_settle, fut, False, f"the agent process exited (code {code})")
        self._pending.clear()

    def close(self, timeout_s: float = 10.0) -> None:
        self._send(("stop",))
        self._closed = True
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout_s)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(RuntimeError(f"the agent raised (in the agent process): {value}"))


# ---- the child ------------------------------------------------------------------------------

def _load(path: str) -> Any:
    """The agent "package.module:function" (the instance checked the path when it loaded it)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _host_main(conn: Connection) -> None:
    # threads.py, not agent.py: this process imports no torch (only what the agents import)
    from asyncflow.agents.serving.threads import on_own_thread
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    tasks: dict[int, asyncio.Task] = {}
    fns: dict[str, Any] = {}
    settled: set[str] = set()  # agents that finished an episode: their imports and clients are made

    async def run_one(cid: int, fn_path: str, row: dict, base_url: str, key: str) -> None:
        try:
            fn = fns.get(fn_path) or fns.setdefault(fn_path, _load(fn_path))
            if asyncio.iscoroutinefunction(fn):
                reward = await fn(row, base_url, key)
            else:
                reward = await on_own_thread(fn, row, base_url, key)
            reply = (cid, True, reward)
            if fn_path not in settled:
                # what an agent's first episode left alive (modules, its HTTP client) lives as long as
                # this process: frozen, the collector stops walking it in every full collection
                settled.add(fn_path)
                gc.freeze()
        except asyncio.CancelledError:
            reply = (cid, False, "cancelled")
        except Exception as e:  # noqa: BLE001 - the episode reports it
            reply = (cid, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
        finally:
            tasks.pop(cid, None)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. a reward that does not pickle
            conn.send((cid, False, f"its result could not be sent back: {type(e).__name__}: {e}"))

    def dispatch(msg: tuple) -> None:
        if msg[0] == "run":
            tasks[msg[1]] = loop.create_task(run_one(*msg[1:]))
        elif msg[0] == "cancel" and msg[1] in tasks:
            tasks[msg[1]].cancel()
        elif msg[0] == "stop":
            loop.stop()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the instance is gone
                msg = ("stop",)
            loop.call_soon_threadsafe(dispatch, msg)
            if msg[0] == "stop":
                return
    threading.Thread(target=read, name="agent-host-reader", daemon=True).start()
    conn.send("ready")
    loop.run_forever()


if __name__ == "__main__":
    _host_main(Connection(int(sys.argv[1])))
