"""What the simulation measures of the real control plane while a run goes on.

- CPU of a thread (the TransferQueue controller's event loop, the driver's loop) and of a
  process (the hosts of simulated ranks), from the kernel's clocks: busy share = CPU
  seconds / wall seconds.
- get_meta latency as a client sees it: a separate process asks the controller for a row
  that is never there (``allow_partial``: an immediate, empty answer) every few ms, so
  what it measures is the transport and the controller's queue under the run's load.
- RPC fan-out latency: the driver calls a no-op method on every rank of a group (served
  on the ranks' control servers) and times the whole gather.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

from ..transfer_queue import TransferQueueClient


def thread_cpu_s(name: str) -> float:
    """CPU seconds of this process's thread called ``name`` so far."""
    for t in threading.enumerate():
        if t.name == name and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    raise LookupError(f"no thread named {name!r} in this process")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU of the machine, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return float(sum(vals) - idle), float(sum(vals))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _latency_probe(address: str, interval_s: float, conn: Any) -> None:
    tq = TransferQueueClient(address, timeout=30.0)
    tq.create_partition("probe")
    out: list[float] = []
    recording = False
    while True:
        if conn.poll():
            msg = conn.recv()
            if msg == "start":
                recording, out = True, []
            elif msg == "stop":
                conn.send(out)
                recording = False
            elif msg == "exit":
                tq.close()
                return
        t0 = time.perf_counter()
        tq.get_meta(["never_written"], 1, "probe", "probe", allow_partial=True, timeout=10.0)
        if recording:
            out.append(time.perf_counter() - t0)
        time.sleep(interval_s)


class GetMetaProbe:
    """A process that times get_meta round trips; ``window()`` brackets the measured part."""

    def __init__(self, controller_address: str, interval_s: float = 0.02):
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_latency_probe, args=(controller_address, interval_s, theirs),
                                name="sim-get-meta-probe", daemon=True)
        self.proc.start()

    def start(self) -> None:
        self._conn.send("start")

    def stop(self, timeout_s: float = 30.0) -> list[float]:
        self._conn.send("stop")
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the get_meta probe did not report within {timeout_s:.0f} s")
        return self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send("exit")
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class FanOutProbe:
    """Times ``group.noop()`` (every rank of the group) every ``interval_s`` on the driver's loop."""

    def __init__(self, group: Any, interval_s: float = 1.0):
        self.group, self.interval_s = group, interval_s
        self.latencies: list[float] = []
        self.recording = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fan-out-probe")

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await self.group.noop(_timeout=60.0)
            if self.recording:
                self.latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def summary_us(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_us": percentile(xs, 0.5) * 1e6, "p99_us": percentile(xs, 0.99) * 1e6,
            "mean_us": (statistics.fmean(xs) * 1e6) if xs else float("nan")}
