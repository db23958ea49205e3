"""Driver -> worker call round trip: AsyncFlow's control plane vs torch.distributed.rpc.

The same call (a small argument, echoed back) from one driver process to 1 and to 4
worker processes on this machine: ours is ``await wg.echo(x)`` (ONE_TO_ALL over ZMQ, one
call per worker, gathered); torch's is ``rpc_async`` to every worker, then wait for all.

Both systems run at once (our driver in this process, torch's rank 0 in a child), with
their workers alive side by side, and the measured calls are interleaved in short
blocks (ours, torch, torch, ours, ...; ``--blocks`` blocks of each), so that the noise
of a shared machine hits both alike. Calls are sequential, so calls/s = 1 / mean
latency. Reported: p50/p99 over all calls of each system, the ratio of the p50s, and
the median over blocks of the paired ratio (torch block p50 / our block p50). The last
line printed is one JSON object.

    PYTHONPATH=. python perf/bench_rpc.py --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncflow.single_controller import Dispatch, Worker, register


class BenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return x


def _stats(lat_s: list[float]) -> dict:
    lat = sorted(lat_s)
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
            "calls_per_s": len(lat) / sum(lat)}


# ---- torch.distributed.rpc: rank 0 runs blocks of calls when told to ---------------------

def _echo(x):
    return x


def _torch_rpc_rank(rank: int, world: int, port: int, conn) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings
    warnings.filterwarnings("ignore", message="You are using a Backend")  # TensorPipe's own init
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        names = [f"r{r}" for r in range(1, world)]
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            start, n = cmd
            lat = []
            for i in range(start, start + n):
                t0 = time.perf_counter()
                res = [f.wait() for f in [rpc.rpc_async(w, _echo, args=({"i": i},)) for w in names]]
                lat.append(time.perf_counter() - t0)
                assert res == [{"i": i}] * len(names)
            conn.send(lat)
    rpc.shutdown()


class TorchRpc:
    """torch.distributed.rpc's driver (rank 0) and ``n_workers`` workers, as child processes."""

    def __init__(self, n_workers: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        world = n_workers + 1
        self.procs = [ctx.Process(target=_torch_rpc_rank, args=(r, world, port, child if r == 0 else None),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        if not self.conn.poll(timeout) or self.conn.recv() != "ready":
            raise RuntimeError("torch.distributed.rpc did not start")

    def block(self, start: int, n: int) -> list[float]:
        self.conn.send((start, n))
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


# ---- both, interleaved ---------------------------------------------------------------------

def bench_pair(n_workers: int, calls: int, warmup: int, blocks: int) -> dict:
    from asyncflow.single_controller import Driver, DriverConfig, LaunchConfig
    from asyncflow.single_controller.local import LocalWorkers

    per = max(1, calls // blocks)
    torch_rpc = TorchRpc(n_workers)
    try:
        with LocalWorkers(n_workers, LaunchConfig(platform="cpu", transfer_queue=False)) as workers:
            torch_rpc.wait_ready()

            async def go() -> dict:
                async with Driver(workers.addresses, config=DriverConfig(call_timeout_s=30)) as d:
                    wg = await d.create_group(BenchWorker, "bench")

                    async def ours_block(start: int, n: int) -> list[float]:
                        lat = []
                        for i in range(start, start + n):
                            t0 = time.perf_counter()
                            out = await wg.echo({"i": i})
                            lat.append(time.perf_counter() - t0)
                            assert out == [{"i": i}] * n_workers
                        return lat

                    await ours_block(0, warmup)
                    torch_rpc.block(0, warmup)
                    ours, theirs, paired = [], [], []
                    for b in range(blocks):
                        start = warmup + b * per
                        if b % 2 == 0:  # ABBA order: neither side always runs right after the other
                            o = await ours_block(start, per)
                            t = torch_rpc.block(start, per)
                        else:
                            t = torch_rpc.block(start, per)
                            o = await ours_block(start, per)
                        ours += o
                        theirs += t
                        paired.append(statistics.median(t) / statistics.median(o))
                    return {"ours": _stats(ours), "torch_rpc": _stats(theirs),
                            "paired_ratio_median": statistics.median(paired), "calls": len(ours)}
            return asyncio.run(go())
    finally:
        torch_rpc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (~1 minute on 2 cores)")
    ap.add_argument("--calls", type=int, default=None, help="measured calls per system and worker count")
    ap.add_argument("--blocks", type=int, default=20, help="alternating blocks the calls are split into")
    a = ap.parse_args()
    calls = a.calls or (300 if a.quick else 3000)
    warmup = 30 if a.quick else 200
    rows = {n: bench_pair(n, calls, warmup, a.blocks) for n in (1, 4)}
    print(f"{'workers':>7} {'impl':>10} {'p50 us':>9} {'p99 us':>9} {'calls/s':>9}")
    for n, r in rows.items():
        for impl in ("ours", "torch_rpc"):
            s = r[impl]
            print(f"{n:>7} {impl:>10} {s['p50_us']:>9.0f} {s['p99_us']:>9.0f} {s['calls_per_s']:>9.0f}")
        print(f"{n:>7} {'ratio':>10} {r['torch_rpc']['p50_us'] / r['ours']['p50_us']:>9.2f}  (torch_rpc p50 / ours; "
              f"median of {a.blocks} paired blocks: {r['paired_ratio_median']:.2f})")
    one, four = rows[1], rows[4]
    print(json.dumps({
        "calls": one["calls"], "blocks": a.blocks, "interleaved": True,
        "rpc_p50_us": round(one["ours"]["p50_us"], 1), "rpc_p99_us": round(one["ours"]["p99_us"], 1),
        "rpc_calls_per_s": round(one["ours"]["calls_per_s"], 1),
        "torch_rpc_p50_us": round(one["torch_rpc"]["p50_us"], 1),
        "torch_rpc_p99_us": round(one["torch_rpc"]["p99_us"], 1),
        "torch_rpc_calls_per_s": round(one["torch_rpc"]["calls_per_s"], 1),
        "ratio_torch_rpc_vs_ours": round(one["torch_rpc"]["p50_us"] / one["ours"]["p50_us"], 2),
        "paired_block_ratio_median": round(one["paired_ratio_median"], 2),
        "rpc_4w_p50_us": round(four["ours"]["p50_us"], 1), "rpc_4w_p99_us": round(four["ours"]["p99_us"], 1),
        "rpc_4w_calls_per_s": round(four["ours"]["calls_per_s"], 1),
        "torch_rpc_4w_p50_us": round(four["torch_rpc"]["p50_us"], 1),
        "torch_rpc_4w_p99_us": round(four["torch_rpc"]["p99_us"], 1),
        "torch_rpc_4w_calls_per_s": round(four["torch_rpc"]["calls_per_s"], 1),
        "ratio_torch_rpc_vs_ours_4w": round(four["torch_rpc"]["p50_us"] / four["ours"]["p50_us"], 2),
        "paired_block_ratio_median_4w": round(four["paired_ratio_median"], 2),
    }))


if __name__ == "__main__":
    main()
