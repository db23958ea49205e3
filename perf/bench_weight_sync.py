"""Weight sync speed: the actor's packed weights to one rollout process over gloo.

Two processes on this machine; the sender packs a state dict of ``--mb`` megabytes
(float32, tensors of a transformer's shapes) and sends it with the same WeightSender /
WeightReceiver the trainer uses (background threads, one broadcast per dtype). Reports
the median over rounds of pack+send+receive, per MB. Used by perf/bench_rollout.py and
runnable alone:

    python perf/bench_weight_sync.py [--mb 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_dict(mb: float):
    import torch
    hidden = 512
    per_layer = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden),
                 "up": (4 * hidden, hidden), "down": (hidden, 4 * hidden), "norm": (hidden,)}
    sd, total, i = {}, 0, 0
    while total < mb * 2**20:
        for name, shape in per_layer.items():
            t = torch.randn(*shape)
            sd[f"layers.{i}.{name}.weight"] = t
            total += t.numel() * 4
        i += 1
    return sd


def _child(rank: int, port: int, mb: float, rounds: int, q) -> None:
    import torch
    import torch.distributed as dist

    from asyncflow.workers import weight_sync as ws
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")  # as Driver.make_group makes it
    sd = _state_dict(mb) if rank == 0 else None
    times = []
    sender = ws.WeightSender(0, {0: group}, 120) if rank == 0 else None
    recv = ws.WeightReceiver(0, group, 120) if rank == 1 else None
    for v in range(rounds + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            sender.publish(ws.pack_weights(sd, v, v + 1))
            sender.wait()
        else:
            recv.start(v)
            recv.join()
            recv.take()
        dist.barrier()
        if v:
            times.append(time.perf_counter() - start)
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        q.put({"weight_sync_mb": round(nbytes / 2**20, 1),
               "weight_sync_ms_per_mb": round(statistics.median(times) * 1000 / (nbytes / 2**20), 3),
               "weight_sync_gb_per_s": round(nbytes / statistics.median(times) / 1e9, 3)})
    dist.destroy_process_group()


def measure(mb: float = 64.0, rounds: int = 5) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_child, args=(r, port, mb, rounds, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(json.dumps(measure(a.mb, a.rounds)))


if __name__ == "__main__":
    main()
