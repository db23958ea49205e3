"""Weight sync over gloo between two processes: background send, background receive,
versions in order, packed views equal the original tensors; a missing sender times out."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncflow.workers import weight_sync as ws


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g),
            "c.half": torch.randn(2, 2, generator=g).to(torch.bfloat16), "d.ids": torch.arange(3) + v}


def _child(rank: int, port: int, q) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        group = dist.new_group([0, 1], backend="gloo")
        if rank == 0:
            sender = ws.WeightSender(0, {0: group}, timeout_s=30)
            for v in (1, 2):
                sender.publish(ws.pack_weights(_weights(v), v, seq=v))
            sender.wait()
            q.put(("sent", sender.sent_bytes))
        else:
            recv = ws.WeightReceiver(0, group, timeout_s=30)
            got = []
            for v in (1, 2):
                recv.start(v)
                recv.join()
                packed = recv.take()
                sd = packed.state_dict()
                want = _weights(v)
                assert list(sd) == list(want)
                assert all(torch.equal(sd[k], want[k]) and sd[k].dtype == want[k].dtype for k in want)
                got.append(packed.header.version)
            # nobody sends version 3: the wait ends with an error that names it
            recv.timeout_s = 1.0
            recv.start(3)
            try:
                recv.join()
                q.put(("no-timeout", None))
            except TimeoutError as e:
                q.put(("received", got, str(e)))
            return
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put(("error", rank, repr(e)))


@pytest.mark.slow
def test_two_versions_arrive_in_order_and_a_silent_sender_times_out():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_child, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=90) for _ in range(2)]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    assert not [r for r in results if r[0] == "error"], results
    sent = next(r for r in results if r[0] == "sent")
    assert sent[1] == 2 * ws.pack_weights(_weights(1), 1).header.nbytes
    recv = next(r for r in results if r[0] == "received")
    assert recv[1] == [1, 2]
    assert "version 3" in recv[2]


def test_pack_views_round_trip_and_sizes():
    sd = _weights(7)
    packed = ws.pack_weights(sd, 7, seq=3)
    assert packed.header.seq == 3 and packed.header.version == 7
    out = packed.state_dict()
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert packed.header.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert set(packed.buffers) == {"float32", "bfloat16", "int64"}


def test_pack_rejects_non_tensors():
    with pytest.raises(TypeError, match="'x'"):
        ws.pack_weights({"x": 3}, 0)
