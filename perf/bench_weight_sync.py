"""Weight sync against a bare broadcast of the same bytes, over one gloo world on this machine.

Four processes: ranks 0 and 1 train (FSDP2 over both, a model of ``--mb`` megabytes in
fp32), ranks 2 and 3 are rollout instances. Each training rank has its own group with both
instances, as the trainer makes them.

- ``sync``: the trainer's path (asyncflow/weight_sync/send.py, receive.py) with
  buckets of ``--bucket-mb`` (default: ``weight_sync.bucket_mb``'s): every training rank
  broadcasts its own rows of each sharded tensor (large runs from the tensor's own memory,
  small ones packed), all ranks at once; the instances receive into their staging weights
  (``weight_sync.load=staged``).
- ``raw``: ``torch.distributed.broadcast`` of the same bytes as whole buckets (bucket b from
  training rank b % 2, on the same weight-sync groups) from buffers filled beforehand, every
  broadcast posted at once: the wire alone. Measured at the sync's bucket size and at each
  of ``--raw-bucket-mb``; the headline ratio is against the fastest of them (the strongest
  raw), with the ratio at the sync's own buckets beside it.

All entries take turns round by round, in rotating order (after one warm-up each); ratios
are of the medians. ``peak_sender_extra_mb`` is the most memory a sender allocated for
sending at once (casts and packed small tensors, filled and on the wire; messages sent from
the tensors' own memory count nothing), from the sender's own accounting. Also prints
PROJECTED sync times for Qwen2.5-7B and 32B at 25, 100 and 400 GB/s links: bytes in bf16
over the link speed, scaled by the ratio measured here (a projection, not a measurement).

    python perf/bench_weight_sync.py [--quick] [--mb 128] [--bucket-mb 64] [--raw-bucket-mb 16,64]
                                     [--rounds 5] [--max-inflight 1]

The last line is one JSON object: weight_sync_gbps, raw_broadcast_gbps (the strongest raw),
raw_best_bucket_mb, raw_gbps_by_bucket_mb, ratio_sync_vs_raw, ratio_spread,
ratio_vs_raw_same_buckets, peak_sender_extra_mb, model_mb, bucket_mb, rounds.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
import traceback
from datetime import timedelta

TRAIN, RECV = [0, 1], [2, 3]
# published parameter counts (Qwen2.5 technical report / model cards): 7.62B and 32.8B
PROJECT = {"Qwen2.5-7B": 7.62e9, "Qwen2.5-32B": 32.8e9}
LINKS_GBPS = (25, 100, 400)
RAW_BUCKET_MB = (16.0, 64.0)  # raw's strongest bucket size on this machine is found among these


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(mb: float):
    """Decoder-like tensors: an embedding, then layers of attention and MLP projections."""
    import torch
    from torch import nn

    hidden = 512

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.o = nn.Linear(hidden, hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)
            self.norm = nn.LayerNorm(hidden)

    per_layer = sum(p.numel() for p in Layer().parameters()) * 4
    embed = 8192 * hidden * 4
    n_layers = max(1, round((mb * 2**20 - embed) / per_layer))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8192, hidden)
            self.layers = nn.ModuleList([Layer() for _ in range(n_layers)])
            self.norm = nn.LayerNorm(hidden)
    torch.manual_seed(0)
    return Net()


def _child(rank: int, port: int, mb: float, bucket_mb: float, rounds: int, inflight: int, q,
           raw_mbs: tuple[float, ...] = (16.0,)) -> None:
    try:
        import torch
        import torch.distributed as dist

        from asyncflow.weight_sync.protocol import make_header
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.send import BucketSender
        from asyncflow.weight_sync.shards import local_tensors
        from asyncflow.weight_sync.sinks import StagingSink
        from asyncflow.weight_sync.wire_group import WireGroup, open_store

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                                timeout=timedelta(seconds=300))
        train = dist.new_group(TRAIN, backend="gloo")
        # the weight-sync groups as the trainer makes them: training rank a hosts its group's
        # store and is member 0; the instances join as members 1 and 2
        opened = open_store(1 + len(RECV), "gloo", f"bench{rank}", 300, host="127.0.0.1") if rank in TRAIN else None
        addrs: list = [None] * 4
        dist.all_gather_object(addrs, opened[1] if opened else None)
        if rank in TRAIN:
            groups = {TRAIN.index(rank): WireGroup(addrs[rank], 0, 300, store=opened[0])}
        else:
            groups = {k: WireGroup(addrs[a], 1 + RECV.index(rank), 300) for k, a in enumerate(TRAIN)}
        net = _model(mb)
        if rank in TRAIN:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard
            mesh = DeviceMesh.from_group(train, device_type="cpu")
            for layer in net.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            index = TRAIN.index(rank)
            sender = BucketSender(rank, index, groups[index], lambda: [], timeout_s=300, train_ranks=TRAIN,
                                  gather_all=False, max_inflight=inflight)
        else:
            sink = StagingSink(lambda sd, v: None)
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=300)
        named = local_tensors(net)
        header = make_header(named, 0, 0, int(bucket_mb * 2**20), len(TRAIN), None)
        nb = len(header.buckets)
        # raw: whole buckets of each size, filled beforehand, on their sources (bucket b from
        # training rank b % 2); receive buffers elsewhere
        raw_headers = {mb_: make_header(named, 0, 0, int(mb_ * 2**20), len(TRAIN), None) for mb_ in raw_mbs}
        raw_bufs = {mb_: [torch.full((h.bucket_nbytes(b),), b % 251, dtype=torch.uint8) for b in range(len(h.buckets))
                          if rank in RECV or h.source(b) == TRAIN.index(rank)] for mb_, h in raw_headers.items()}

        def run_sync(v: int) -> float:
            dist.barrier()
            start = time.perf_counter()
            if rank in TRAIN:
                h = make_header(named, v, v, int(bucket_mb * 2**20), len(TRAIN), None)
                stats = sender.send(h, named)
                sender.settle()  # what send left on the wire (header, copies) is part of the sync
                peaks.append(stats.peak_extra_bytes)
            else:
                def load(h, tensors):
                    sink.begin(h)
                    for spec, t in tensors:
                        sink.tensor(spec, t)
                    sink.end(h)
                recv.start(v, load, sink.bucket_buffer)  # into the staging bytes, as the trainer does
                recv.join()
                assert sink.take()[0].version == v
            dist.barrier()
            return time.perf_counter() - start

        def run_raw(mb_: float) -> float:
            h = raw_headers[mb_]
            dist.barrier()
            start = time.perf_counter()
            works, i = [], 0
            for b in range(len(h.buckets)):
                src = h.source(b)
                if rank in RECV or src == TRAIN.index(rank):
                    works.append(groups[src].broadcast(raw_bufs[mb_][i], 0))
                    i += 1
            for w in works:
                w.wait()
            dist.barrier()
            return time.perf_counter() - start

        peaks: list[int] = []
        sync_t: list[float] = []
        raw_t: dict[float, list[float]] = {mb_: [] for mb_ in raw_mbs}
        entries = ["sync", *raw_mbs]
        run_sync(1)
        for mb_ in raw_mbs:
            run_raw(mb_)  # a warm-up of each
        for r in range(rounds):  # in turns, the order rotating round by round
            for e in entries[r % len(entries):] + entries[:r % len(entries)]:
                if e == "sync":
                    sync_t.append(run_sync(r + 2))
                else:
                    raw_t[e].append(run_raw(e))
        if rank == 0:
            q.put({"nbytes": header.nbytes, "buckets": nb, "sync": sync_t, "raw": raw_t,
                   "peak": max(peaks)})
        elif rank == 1:
            q.put({"peak1": max(peaks)})
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        q.put({"error": rank, "trace": traceback.format_exc()})


def measure(mb: float = 64.0, bucket_mb: float = 64.0, rounds: int = 5, inflight: int = 1,
            raw_mbs: tuple[float, ...] = RAW_BUCKET_MB) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    raw_mbs = tuple(dict.fromkeys((*raw_mbs, bucket_mb)))  # always also the sync's own buckets
    procs = [ctx.Process(target=_child, args=(r, port, mb, bucket_mb, rounds, inflight, q, raw_mbs), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=900) for _ in range(2)]
    for p in procs:
        p.join(timeout=60)
    errors = [g for g in got if "error" in g]
    if errors:
        raise RuntimeError(f"bench_weight_sync: rank {errors[0]['error']} failed:\n{errors[0]['trace']}")
    main = next(g for g in got if "nbytes" in g)
    peak = max(main["peak"], next(g for g in got if "peak1" in g)["peak1"])
    sync_s = statistics.median(main["sync"])
    raw_s = {k: statistics.median(v) for k, v in main["raw"].items()}
    best = min(raw_s, key=raw_s.get)  # the strongest raw: its fastest bucket size
    gbps = lambda s: round(main["nbytes"] / s / 1e9, 3)  # noqa: E731
    return {"model_mb": round(main["nbytes"] / 2**20, 1), "bucket_mb": bucket_mb, "buckets": main["buckets"],
            "max_inflight": inflight,
            "rounds": rounds, "weight_sync_gbps": gbps(sync_s),
            "raw_broadcast_gbps": gbps(raw_s[best]), "raw_best_bucket_mb": best,
            "raw_gbps_by_bucket_mb": {str(k): gbps(v) for k, v in raw_s.items()},
            "ratio_sync_vs_raw": round(raw_s[best] / sync_s, 3),
            "ratio_spread": [round(r / s, 3) for s, r in zip(main["sync"], main["raw"][best])],
            "ratio_vs_raw_same_buckets": round(raw_s[bucket_mb] / sync_s, 3),
            "peak_sender_extra_mb": round(peak / 2**20, 1)}


def projections(ratio: float) -> list[str]:
    lines = ["PROJECTED (not measured): bf16 weights over one link, divided by this run's ratio_sync_vs_raw",
             f"{'model':<14}" + "".join(f"{f'{g} GB/s':>12}" for g in LINKS_GBPS)]
    for name, params in PROJECT.items():
        nbytes = params * 2
        lines.append(f"{name:<14}" + "".join(f"{nbytes / (g * 1e9) / max(ratio, 1e-9):>11.2f}s" for g in LINKS_GBPS))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MB model, 5 rounds")
    ap.add_argument("--mb", type=float, default=128.0)
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="the sync's buckets (weight_sync.bucket_mb's default)")
    ap.add_argument("--raw-bucket-mb", default=",".join(str(x) for x in RAW_BUCKET_MB),
                    help="bucket sizes raw is measured at (besides --bucket-mb); the fastest is the headline's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-inflight", type=int, default=1, help="weight_sync.max_inflight of the senders")
    a = ap.parse_args()
    mb, rounds = (64.0, 5) if a.quick else (a.mb, a.rounds)
    out = measure(mb, a.bucket_mb, rounds, a.max_inflight, tuple(float(x) for x in a.raw_bucket_mb.split(",") if x))
    for line in projections(out["ratio_sync_vs_raw"]):
        print(line)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
