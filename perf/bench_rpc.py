"""Driver -> worker call round trip: AsyncFlow's control plane vs torch.distributed.rpc.

The same call (a small argument, echoed back) from one driver process to 1 and to 4
worker processes on this machine: ours is ``await wg.echo(i)`` (ONE_TO_ALL over ZMQ,
one call per worker, gathered); torch's is ``rpc_async`` to every worker, then wait
for all. Calls are sequential, so calls/s = 1 / mean latency. The last line printed is
one JSON object.

    PYTHONPATH=. python perf/bench_rpc.py --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncflow.single_controller import Dispatch, Worker, register  # noqa: E402


class BenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return x


def _stats(lat_s: list[float]) -> dict:
    lat = sorted(lat_s)
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
            "calls_per_s": len(lat) / sum(lat)}


# ---- ours ------------------------------------------------------------------------------

def bench_ours(n_workers: int, calls: int, warmup: int) -> dict:
    from asyncflow.single_controller import Driver, DriverConfig, RunConfig
    from asyncflow.single_controller.local import LocalWorkers

    with LocalWorkers(n_workers, RunConfig(platform="cpu", transfer_queue=False)) as workers:
        async def go() -> list[float]:
            async with Driver(workers.addresses, config=DriverConfig(call_timeout_s=30)) as d:
                wg = await d.create_group(BenchWorker, "bench")
                for i in range(warmup):
                    await wg.echo(i)
                lat = []
                for i in range(calls):
                    t0 = time.perf_counter()
                    out = await wg.echo({"i": i})
                    lat.append(time.perf_counter() - t0)
                    assert out == [{"i": i}] * n_workers
                return lat
        return _stats(asyncio.run(go()))


# ---- torch.distributed.rpc ---------------------------------------------------------------

def _echo(x):
    return x


def _torch_rpc_rank(rank: int, world: int, port: int, calls: int, warmup: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings
    warnings.filterwarnings("ignore", message="You are using a Backend")  # TensorPipe's own init
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        names = [f"r{r}" for r in range(1, world)]
        for i in range(warmup):
            [f.wait() for f in [rpc.rpc_async(n, _echo, args=(i,)) for n in names]]
        lat = []
        for i in range(calls):
            t0 = time.perf_counter()
            res = [f.wait() for f in [rpc.rpc_async(n, _echo, args=({"i": i},)) for n in names]]
            lat.append(time.perf_counter() - t0)
            assert res == [{"i": i}] * len(names)
        out.put(lat)
    rpc.shutdown()


def bench_torch_rpc(n_workers: int, calls: int, warmup: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = n_workers + 1
    procs = [ctx.Process(target=_torch_rpc_rank, args=(r, world, port, calls, warmup, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        lat = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return _stats(lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (~1 minute on 2 cores)")
    ap.add_argument("--calls", type=int, default=None)
    a = ap.parse_args()
    calls = a.calls or (300 if a.quick else 3000)
    warmup = 30 if a.quick else 200
    rows = {}
    for n in (1, 4):
        rows[n] = {"ours": bench_ours(n, calls, warmup), "torch_rpc": bench_torch_rpc(n, calls, warmup)}
    print(f"{'workers':>7} {'impl':>10} {'p50 us':>9} {'p99 us':>9} {'calls/s':>9}")
    for n, r in rows.items():
        for impl, s in r.items():
            print(f"{n:>7} {impl:>10} {s['p50_us']:>9.0f} {s['p99_us']:>9.0f} {s['calls_per_s']:>9.0f}")
        print(f"{n:>7} {'ratio':>10} {r['torch_rpc']['p50_us'] / r['ours']['p50_us']:>9.2f}  (torch_rpc p50 / ours)")
    one, four = rows[1], rows[4]
    print(json.dumps({
        "calls": calls,
        "rpc_p50_us": round(one["ours"]["p50_us"], 1), "rpc_p99_us": round(one["ours"]["p99_us"], 1),
        "rpc_calls_per_s": round(one["ours"]["calls_per_s"], 1),
        "torch_rpc_p50_us": round(one["torch_rpc"]["p50_us"], 1),
        "torch_rpc_p99_us": round(one["torch_rpc"]["p99_us"], 1),
        "torch_rpc_calls_per_s": round(one["torch_rpc"]["calls_per_s"], 1),
        "ratio_torch_rpc_vs_ours": round(one["torch_rpc"]["p50_us"] / one["ours"]["p50_us"], 2),
        "rpc_4w_p50_us": round(four["ours"]["p50_us"], 1), "rpc_4w_p99_us": round(four["ours"]["p99_us"], 1),
        "rpc_4w_calls_per_s": round(four["ours"]["calls_per_s"], 1),
        "torch_rpc_4w_p50_us": round(four["torch_rpc"]["p50_us"], 1),
        "torch_rpc_4w_p99_us": round(four["torch_rpc"]["p99_us"], 1),
        "ratio_torch_rpc_vs_ours_4w": round(four["torch_rpc"]["p50_us"] / four["ours"]["p50_us"], 2),
    }))


if __name__ == "__main__":
    main()
