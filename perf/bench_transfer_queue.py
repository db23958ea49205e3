"""TransferQueue throughput and get_meta latency, measured side by side in one run.

Three processes: producer -> storage -> consumer. The same payload (1024 rows: prompts
of ~256 tokens, responses with a long-tailed length up to 2048, three scalar columns)
moves over the same hops three ways:

  raw     zero-copy ZMQ frames of the same buffers, no framework at all (the floor)
  pickle  the naive store: the TensorDict is pickled to the storage process, which unpickles
          it (a store must see columns and rows to serve them), pickles the requested
          columns on a get, and the consumer unpickles them
  tq      TransferQueue put, then get_batch: get_meta + get_data, in one hop when the
          controller's process holds the rows, as here (controller + unit in the storage process)

and, to tell TQ's own work from its transport's, a fourth method that is not a store:

  transport  TQ's RPC layer alone (RpcServer, BlockingRpcClient, the codec's header + tensor
          frames, the MAC) carrying the same buffers: the storage keeps each put's decoded
          tensors and answers a get with the oldest; no controller, no unit, no TensorDict

Every method first moves one payload and streams two rounds untimed (warm-up), then the
methods take turns, round by round. Then get_meta latency with 10k and 1M rows in the
partition, and with 16 concurrent clients. The last line is one JSON object.

Beside throughput, each method's CPU per payload in the streaming rounds (every thread of
its three processes, from /proc on Linux; the bench's own checksum left out). On a machine
with fewer cores than busy threads, throughput follows that total: ``ratio_cpu_raw_vs_tq``
says how much of TQ's gap to the floor is its own work, and ``ratio_cpu_transport_vs_tq``
how much of that is TQ's logic on top of its transport. The CPU figures move with the
machine's state too (a memory-bound copy costs more CPU when other tenants load the
host), so compare methods within one run, as the throughputs.

    python perf/bench_transfer_queue.py [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = 1024
WARM_STREAM_ROUNDS = 2
COLUMNS = ["prompts", "responses", "reward", "version", "seq_len"]


def make_payload(seed: int = 0) -> dict:
    import torch
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(192, 321, (ROWS,), generator=g)
    # Long tail: most responses short, a few near the 2048 limit (lognormal, clipped).
    resp_len = torch.exp(torch.randn(ROWS, generator=g) * 0.9 + 5.6).clamp(8, 2048).long()
    resp_len[torch.randperm(ROWS, generator=g)[:16]] = 2048
    prompts = [torch.randint(0, 32000, (int(n),), generator=g) for n in prompt_len]
    responses = [torch.randint(0, 32000, (int(n),), generator=g) for n in resp_len]
    return {
        "prompts": torch.nested.nested_tensor(prompts, layout=torch.jagged),
        "responses": torch.nested.nested_tensor(responses, layout=torch.jagged),
        "reward": torch.rand(ROWS, generator=g),
        "version": torch.full((ROWS,), 3, dtype=torch.long),
        "seq_len": prompt_len + resp_len,
    }


def payload_buffers(p: dict) -> list:
    """The bytes any design must move: values + offsets of jagged columns, scalar columns."""
    out = []
    for k in COLUMNS:
        t = p[k]
        if t.is_nested:
            out += [t.values(), t.offsets()]
        else:
            out.append(t)
    return out


def payload_bytes(p: dict) -> int:
    return sum(t.numel() * t.element_size() for t in payload_buffers(p))


def checksum(td_or_dict) -> float:
    s = 0.0
    for k in COLUMNS:
        t = td_or_dict[k]
        s += float((t.values() if t.is_nested else t).double().sum())
    return s


# ---- the storage process ------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _alloc():
    """asyncflow/rpc/alloc.py, loaded (once) from its file alone: the raw and pickle
    stores must not import torch with the asyncflow package."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "asyncflow", "rpc", "alloc.py")
    spec = importlib.util.spec_from_file_location("_rpc_alloc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def keep_freed_memory() -> bool:
    return _alloc().keep_freed_memory()


def freeze_gc_heap() -> None:
    """Every method's processes alike, once their imports are done: the import-time heap is
    kept out of garbage collections, as AsyncFlow's own worker and storage processes do."""
    _alloc().freeze_gc_heap()


def storage_main(mode: str, conn) -> None:
    # Every method's storage process alike: the allocator keeps freed memory for the next
    # messages, as a TransferQueue unit's own process does. --default-malloc turns it off
    # for all of them.
    keep_freed_memory()
    if mode == "tq":
        from asyncflow.transfer_queue import TransferQueueService
        freeze_gc_heap()

        async def run_tq():
            svc = await TransferQueueService().start()
            conn.send(svc.controller_address)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
            await svc.stop()

        asyncio.run(run_tq())
        return
    if mode == "transport":
        freeze_gc_heap()
        asyncio.run(_serve_transport(conn))
        return

    import collections

    import zmq
    freeze_gc_heap()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    stored: collections.deque = collections.deque()  # payloads not yet fetched, oldest first
    waiting: collections.deque = collections.deque()  # consumers that asked before data came

    def serve(ident) -> None:
        item = stored.popleft()
        if mode == "raw":
            sock.send_multipart([ident, b"data", *item], copy=False)
        else:  # the naive store answers a get by pickling the requested columns
            sock.send_multipart([ident, b"data", pickle.dumps(item.select(*COLUMNS), protocol=5)], copy=False)

    while True:
        frames = sock.recv_multipart(copy=False)
        ident, op = frames[0], frames[1].bytes
        if op == b"stop":
            sock.send_multipart([ident, b"ok"])
            break
        if op == b"put":
            # raw keeps the frames as they arrived (zero copy); the naive store unpickles
            stored.append(frames[2:] if mode == "raw" else pickle.loads(frames[2].buffer))
            sock.send_multipart([ident, b"ok"])
            if waiting:
                serve(waiting.popleft())
        elif stored:
            serve(ident)
        else:
            waiting.append(ident)
    sock.close(0)
    ctx.term()


class _TransportStore:
    """The transport method's service: each put's tensors as decoded (views of the received
    frames), answered oldest first; a get before any put waits for one."""

    def __init__(self) -> None:
        self.stored: list = []
        self.arrived = asyncio.Event()

    async def rpc_put(self, columns: dict) -> None:
        self.stored.append(columns)
        self.arrived.set()

    async def rpc_get(self) -> dict:
        while not self.stored:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 120)
        return self.stored.pop(0)


async def _serve_transport(conn) -> None:
    import zmq.asyncio

    from asyncflow.rpc.async_server import RpcServer
    server = RpcServer(_TransportStore(), "tcp://127.0.0.1:0", zmq.asyncio.Context.instance(), "bench-transport")
    server.start()
    conn.send(server.address)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    await server.close()


def _transport_client(address: str):
    import zmq

    from asyncflow.rpc.blocking_client import BlockingRpcClient
    return BlockingRpcClient(address, zmq.Context.instance())


# ---- producer / consumer processes -----------------------------------------------------
# Each serves commands from the parent: ("seq", tag) moves one payload and reports its
# time; ("stream", tag, k) moves k payloads back to back and reports start or end time.

def _one_torch_thread() -> None:
    """Every method's producer and consumer alike: one torch thread. With the default pool,
    the consumer's checksum (outside the timed part) left OpenMP threads spinning for tens of
    milliseconds, stealing the 2 cores from the next round's processes."""
    import torch
    torch.set_num_threads(1)


def producer_main(mode: str, address: str, conn) -> None:
    import torch
    _one_torch_thread()

    p = make_payload()
    if mode == "tq":
        from asyncflow.transfer_queue import TransferQueueClient
        client = TransferQueueClient(address)
        td = _tensordict(p)

        def put(tag: str) -> None:
            client.put(td, tag)
    elif mode == "transport":
        rpc = _transport_client(address)
        wire = {k: {"values": p[k].values(), "offsets": p[k].offsets()} if p[k].is_nested else p[k]
                for k in COLUMNS}

        def put(tag: str) -> None:
            rpc.call("put", columns=wire)
    else:
        import zmq
        sock = zmq.Context().socket(zmq.DEALER)
        sock.connect(address)
        if mode == "raw":
            bufs = [memoryview(b.reshape(-1).contiguous().view(torch.uint8).numpy()) for b in payload_buffers(p)]
        else:
            td = _tensordict(p)

        def put(tag: str) -> None:
            if mode == "raw":
                sock.send_multipart([b"put", *bufs], copy=False)
            else:
                sock.send_multipart([b"put", pickle.dumps(td, protocol=5)], copy=False)
            sock.recv_multipart()

    freeze_gc_heap()
    conn.send(("ready", payload_bytes(p)))
    while (msg := conn.recv())[0] != "stop":
        kind, tag, k = msg
        if mode == "tq":
            client.create_partition(tag)
        conn.send("go")
        conn.recv()
        t0 = time.perf_counter()
        for _ in range(k):
            put(tag)
        conn.send((t0, time.perf_counter()))
    if mode == "tq":
        client.close()
    elif mode == "transport":
        rpc.close()
    else:
        sock.send_multipart([b"stop"])
        sock.recv_multipart()


def _tensordict(p: dict):
    from tensordict import TensorDict
    return TensorDict(p, batch_size=[ROWS])


def consumer_main(mode: str, address: str, conn) -> None:
    import torch
    _one_torch_thread()

    ref = make_payload()
    shapes = [(b.dtype, b.shape) for b in payload_buffers(ref)]
    want = checksum(ref)
    if mode == "tq":
        from asyncflow.transfer_queue import TransferQueueClient
        client = TransferQueueClient(address)
        import tensordict  # noqa: F401  (import cost is not transfer cost)

        def get(tag: str):
            return client.get_batch(COLUMNS, ROWS, "bench", tag)[1]
    elif mode == "transport":
        rpc = _transport_client(address)

        def get(tag: str):  # the decoded tensors as they come, like raw's: no nested tensors
            got = rpc.call("get")
            return {k: got[k]["values"] if isinstance(got[k], dict) else got[k] for k in COLUMNS}
    else:
        import zmq
        sock = zmq.Context().socket(zmq.DEALER)
        sock.connect(address)

        def get(tag: str):
            sock.send_multipart([b"get"])
            frames = sock.recv_multipart(copy=False)[1:]
            if mode == "raw":
                return dict(zip(
                    ["prompts", "p_off", "responses", "r_off", "reward", "version", "seq_len"],
                    [torch.frombuffer(f.buffer, dtype=dt).view(sh) for f, (dt, sh) in zip(frames, shapes)]))
            return pickle.loads(frames[0].buffer)

    freeze_gc_heap()
    conn.send("ready")
    ok = True
    while (msg := conn.recv())[0] != "stop":
        kind, tag, k = msg
        conn.send("go")
        conn.recv()
        t0 = time.perf_counter()
        got = [get(tag) for _ in range(k)]
        t1 = time.perf_counter()
        c0 = time.thread_time()
        ok = ok and all(abs(checksum(g) - want) < 1e-6 * max(1.0, abs(want)) for g in got)
        if mode == "tq":
            client.clear(tag)
        # The checksum is the bench's, not the transfer's: the parent takes this thread's CPU
        # for it (and for asking TQ to clear) out of the round's. What the storage process
        # spends freeing stays counted, as raw's and pickle's stores free theirs in the round.
        conn.send((t0, t1, time.thread_time() - c0))
    conn.send(ok)
    if mode == "tq":
        client.close()
    elif mode == "transport":
        rpc.close()


class Rig:
    """One method's storage, producer and consumer processes, kept up across rounds."""

    def __init__(self, mode: str):
        self.mode = mode
        ctx = mp.get_context("spawn")
        self.s_conn, s_child = ctx.Pipe()
        self.procs = [ctx.Process(target=storage_main, args=(mode, s_child), daemon=True)]
        self.procs[0].start()
        address = _recv(self.s_conn, 60, f"{mode} storage process")
        self.p_conn, p_child = ctx.Pipe()
        self.c_conn, c_child = ctx.Pipe()
        self.procs += [ctx.Process(target=producer_main, args=(mode, address, p_child), daemon=True),
                       ctx.Process(target=consumer_main, args=(mode, address, c_child), daemon=True)]
        for pr in self.procs[1:]:
            pr.start()
        _, self.nbytes = _recv(self.p_conn, 120, f"{mode} producer")
        _recv(self.c_conn, 120, f"{mode} consumer")

    def cpu_s(self) -> float | None:
        """CPU time of every thread of this method's three processes so far (Linux), or None."""
        return process_cpu_s([p.pid for p in self.procs])

    def run(self, kind: str, tag: str, n: int, overlap: bool) -> tuple:
        """n payloads; ``overlap``: gets run while puts do (streaming), else after them.
        ``(p0, p1, c0, c1, cpu_s)``: the producer's and the consumer's start and end times, and
        the CPU the round took in the three processes (None where it cannot be read)."""
        self.p_conn.send((kind, tag, n))
        self.c_conn.send((kind, tag, n))
        _recv(self.p_conn, 60, "producer"), _recv(self.c_conn, 60, "consumer")
        cpu0 = self.cpu_s()
        self.p_conn.send("go")
        if overlap:
            self.c_conn.send("go")
        p0, p1 = _recv(self.p_conn, 120, f"{self.mode} producer puts")
        if not overlap:
            self.c_conn.send("go")
        c0, c1, bench_cpu = _recv(self.c_conn, 120, f"{self.mode} consumer gets")
        cpu1 = self.cpu_s()
        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0 - bench_cpu
        return p0, p1, c0, c1, cpu

    def close(self) -> bool:
        self.p_conn.send(("stop", "", 0))
        self.c_conn.send(("stop", "", 0))
        try:
            ok = _recv(self.c_conn, 60, "consumer checksum")
            if self.mode in ("tq", "transport"):
                self.s_conn.send("stop")
            for pr in self.procs:
                pr.join(30)
        finally:
            self.kill()
        return ok

    def kill(self) -> None:
        for pr in self.procs:
            if pr.is_alive():
                pr.kill()


def transfer(modes: list[str], seq_rounds: int, stream_rounds: int, k: int) -> dict:
    """Sequential rounds (one put, then its get: latency) and streaming rounds (k puts and
    k gets at the same time: sustained throughput). The methods take turns round by round,
    so a slow spell of a shared machine hits all of them alike."""
    rigs: dict[str, Rig] = {}
    try:
        for m in modes:
            rigs[m] = Rig(m)
        for rig in rigs.values():
            rig.run("seq", "warmup", 1, False)
        # Untimed streaming rounds first, for every method alike: the first rounds that hold k
        # payloads at once fault in that memory in every process (measured: raw 0.31, pickle
        # 0.17, TQ 0.20 GB/s in the first one or two such rounds vs ~1.4 / 0.35 / 1.0 after),
        # and a median of three rounds would otherwise report that warm-up.
        for i in range(WARM_STREAM_ROUNDS):
            for rig in rigs.values():
                rig.run("stream", f"warm_{i}", k, True)
        seq: dict = {m: ([], [], []) for m in modes}
        streams: dict = {m: [] for m in modes}
        cpus: dict = {m: [] for m in modes}
        for i in range(seq_rounds):
            for m, rig in rigs.items():
                p0, p1, c0, c1, _ = rig.run("seq", f"seq_{i}", 1, False)
                for lst, v in zip(seq[m], ((p1 - p0) + (c1 - c0), p1 - p0, c1 - c0)):
                    lst.append(v)
        for i in range(stream_rounds):
            for m, rig in rigs.items():
                p0, p1, c0, c1, cpu = rig.run("stream", f"stream_{i}", k, True)
                streams[m].append(k * rig.nbytes / (max(p1, c1) - min(p0, c0)) / 1e9)
                if cpu is not None:
                    cpus[m].append(cpu / k * 1e3)
        intact = {m: rig.close() for m, rig in rigs.items()}
    finally:
        for rig in rigs.values():
            rig.kill()
    med = statistics.median
    return {m: {"mode": m, "bytes": rigs[m].nbytes, "intact": intact[m], "gbps": med(streams[m]),
                "roundtrip_ms": med(seq[m][0]) * 1e3, "put_ms": med(seq[m][1]) * 1e3,
                "get_ms": med(seq[m][2]) * 1e3, "cpu_ms": med(cpus[m]) if cpus[m] else None} for m in modes}


def process_cpu_s(pids: list[int]) -> float | None:
    """Seconds on CPU of every thread of ``pids`` (/proc/PID/task/*/schedstat, in ns: far finer
    than the 10 ms ticks of /proc/PID/stat), or None where /proc does not have it."""
    total = 0
    try:
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except FileNotFoundError:  # a thread that ended meanwhile: its time is lost
                    continue
    except (FileNotFoundError, NotADirectoryError, ValueError, IndexError):
        return None
    return total / 1e9


def _recv(conn, timeout: float, what: str):
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from the {what} within {timeout}s")
    return conn.recv()


# ---- get_meta latency -------------------------------------------------------------------

def latency_main(address: str, rows: int, clients: int, calls: int, conn) -> None:
    import torch

    from asyncflow.transfer_queue import AsyncTransferQueueClient

    async def run():
        cs = [AsyncTransferQueueClient(address) for _ in range(clients)]
        part = f"lat_{rows}_{clients}"
        await cs[0].create_partition(part)
        chunk = 10_000
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            await cs[0].put({"x": torch.arange(start, start + n)}, part)
        for c in cs:  # warm-up: the first request of a task builds its ready set once
            await c.get_meta(["x"], 1, "lat", part)
        lat: list[float] = []
        n_calls = min(calls, (rows - clients) // (16 * clients))  # never ask for more rows than exist

        async def loop(c):
            for _ in range(n_calls):
                t0 = time.perf_counter()
                m = await c.get_meta(["x"], 16, "lat", part)
                lat.append(time.perf_counter() - t0)
                assert len(m) == 16

        await asyncio.gather(*(loop(c) for c in cs))
        await cs[0].clear(part)
        for c in cs:
            await c.close()
        return lat

    try:
        lat = sorted(asyncio.run(run()))
    except Exception:  # noqa: BLE001 - the parent raises it: a dead child must not leave the parent waiting
        import traceback
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6})


def latency(rows: int, clients: int, calls: int) -> dict:
    ctx = mp.get_context("spawn")
    s_conn, s_child = ctx.Pipe()
    storage = ctx.Process(target=storage_main, args=("tq", s_child), daemon=True)
    storage.start()
    try:
        address = _recv(s_conn, 60, "TQ service")
        l_conn, l_child = ctx.Pipe()
        pr = ctx.Process(target=latency_main, args=(address, rows, clients, calls, l_child), daemon=True)
        pr.start()
        res = _recv(l_conn, 300, f"get_meta latency run ({rows} rows)")
        if "error" in res:
            raise RuntimeError(f"get_meta latency run ({rows} rows, {clients} clients) failed:\n{res['error']}")
        pr.join(30)
        s_conn.send("stop")
        storage.join(30)
    finally:
        for p in (storage,):
            if p.is_alive():
                p.kill()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds; finishes in under a minute")
    ap.add_argument("--default-malloc", action="store_true",
                    help="storage processes keep glibc's default trimming (no keep_freed_memory)")
    args = ap.parse_args()
    if args.default_malloc:
        os.environ["ASYNCFLOW_TQ_KEEP_FREED_MB"] = "0"  # alloc.ENV_VAR, inherited by the storage processes
    seq_rounds, stream_rounds, k = (5, 5, 8) if args.quick else (20, 9, 16)
    calls = 200 if args.quick else 1000
    # The storage, producer and consumer processes are siblings: make the run key here, so
    # that each inherits it through the environment (TQ messages are signed with it).
    from asyncflow.rpc import auth
    auth.run_key()
    t0 = time.time()
    res = transfer(["raw", "pickle", "tq", "transport"], seq_rounds, stream_rounds, k)
    print(f"payload: {ROWS} rows, {res['raw']['bytes'] / 1e6:.1f} MB, producer -> storage -> consumer")
    print(f"throughput: {k} payloads streamed with puts and gets running at once (median of {stream_rounds}); "
          f"round trip: one put, then its get (median of {seq_rounds}); methods take turns each round")
    print("CPU ms/payload: on-CPU time of every thread of the three processes during the streaming "
          "rounds, per payload (median; the consumer's checksum left out): what throughput follows "
          "when busy threads outnumber cores")
    print("transport: TQ's RPC layer alone, carrying the same buffers with no controller, unit or "
          "TensorDict (not a store: it tells TQ's logic from its transport)")
    print(f"{'method':9} {'GB/s':>7} {'round trip ms':>14} {'put ms':>8} {'get ms':>8} {'CPU ms/payload':>15} "
          f"{'intact':>7}")
    for m, r in res.items():
        cpu = "n/a" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}"
        print(f"{m:9} {r['gbps']:7.3f} {r['roundtrip_ms']:14.2f} {r['put_ms']:8.2f} {r['get_ms']:8.2f} {cpu:>15} "
              f"{str(r['intact']):>7}")
    l10k = latency(10_000, 1, calls)
    l1m = latency(1_000_000, 1, calls)
    l16 = latency(10_000, 16, max(20, calls // 16))
    print(f"get_meta (16 rows): 10k rows p50 {l10k['p50_us']:.0f} us, p99 {l10k['p99_us']:.0f} us; "
          f"1M rows p50 {l1m['p50_us']:.0f} us, p99 {l1m['p99_us']:.0f} us; "
          f"16 clients p50 {l16['p50_us']:.0f} us, p99 {l16['p99_us']:.0f} us")
    def cpu_ratio(a: str, b: str) -> float | None:
        """Method a's CPU per payload over method b's; None where /proc could not be read."""
        x, y = res[a]["cpu_ms"], res[b]["cpu_ms"]
        return round(x / y, 3) if x and y else None

    out = {
        "tq_gbps": round(res["tq"]["gbps"], 4),
        "raw_gbps": round(res["raw"]["gbps"], 4),
        "pickle_gbps": round(res["pickle"]["gbps"], 4),
        "ratio_tq_vs_raw": round(res["tq"]["gbps"] / res["raw"]["gbps"], 3),
        "ratio_tq_vs_pickle": round(res["tq"]["gbps"] / res["pickle"]["gbps"], 3),
        "cpu_ms_per_payload": {m: None if r["cpu_ms"] is None else round(r["cpu_ms"], 3) for m, r in res.items()},
        # CPU another method needs per payload over CPU TQ needs (higher is better for TQ).
        "ratio_cpu_raw_vs_tq": cpu_ratio("raw", "tq"),
        "ratio_cpu_pickle_vs_tq": cpu_ratio("pickle", "tq"),
        # TQ's transport alone against the floor, and against TQ: where TQ's gap to raw goes.
        "transport_gbps": round(res["transport"]["gbps"], 4),
        "ratio_transport_vs_raw": round(res["transport"]["gbps"] / res["raw"]["gbps"], 3),
        "ratio_cpu_transport_vs_tq": cpu_ratio("transport", "tq"),
        "roundtrip_ms": {m: round(r["roundtrip_ms"], 2) for m, r in res.items()},
        "ratio_tq_vs_raw_roundtrip": round(res["raw"]["roundtrip_ms"] / res["tq"]["roundtrip_ms"], 3),
        "ratio_tq_vs_pickle_roundtrip": round(res["pickle"]["roundtrip_ms"] / res["tq"]["roundtrip_ms"], 3),
        "get_meta_p50_us_10k": round(l10k["p50_us"], 1),
        "get_meta_p50_us_1m": round(l1m["p50_us"], 1),
        "get_meta_p99_us_16_clients": round(l16["p99_us"], 1),
        "payload_mb": round(res["raw"]["bytes"] / 1e6, 2),
        "all_intact": all(r["intact"] for r in res.values()),
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
