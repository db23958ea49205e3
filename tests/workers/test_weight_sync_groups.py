"""Weight sync over real gloo groups: 2 FSDP training ranks to 2 rollout ranks, every training
rank sending its share of the buckets. Bit-identical weights for fp32 and for bf16 casts, a
sender's extra memory about two buckets, and a sender dying mid-version stops everyone as its
connections close (not at a timeout), naming rank, role and bucket, with the receivers keeping
the version they had."""
from __future__ import annotations

import socket

import _weight_sync_procs as P
import pytest
import torch.multiprocessing as mp

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMED_OUT = ("Timed out", "TimeoutError", "did not arrive within", "was not received within",
             "did not receive version")  # how a wait that ran out of time reads, at each layer


def _stopped_by_the_death(msg: str) -> bool:
    """The failure is the peer's death (its connection closed), not a wait running out."""
    return not any(t in msg for t in TIMED_OUT)


def _run(target, n_results: int = 4, timeout: float = 120, *extra) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, q, *extra), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=timeout) for _ in range(n_results)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("gather_all", [False, True])
def test_two_fsdp_ranks_to_two_instances_bit_identical_fp32_and_bf16(gather_all):
    results = _run(P.sync_two_versions, 4, 120, gather_all)
    assert not [r for r in results if r[0] == "error"], results
    sent = sorted((r for r in results if r[0] == "sent"), key=lambda r: r[1])
    got = [r for r in results if r[0] == "received"]
    assert len(sent) == 2 and len(got) == 2
    for _, rank, by_version in got:
        assert by_version[1][:2] == (1, True) and by_version[2][:2] == (2, True), (rank, by_version)
    # every training rank sent a share, and together exactly the version's buckets
    total = sent[0][6]
    assert sent[0][2] > 0 and sent[1][2] > 0
    assert got[0][2][1][2] == sent[0][2] + sent[1][2] >= total
    # peak extra memory of a sender: its bucket in flight + the one it fills, at most two buckets
    for r in sent:
        assert 0 < r[4] <= 2 * r[5], r


@pytest.mark.parametrize("big", [False, True])
def test_send_leaves_copies_on_the_wire_and_settle_waits_for_the_receivers(big):
    """Small tensors only (all packed copies), or with big=True a tensor sent from its own
    memory and ``wait_direct=False``: send returns before any receiver has started (they wait
    for both sends to return), settle only after both receivers started and have the whole
    version, bit-identical though the weights change right after settle."""
    marks = [mp.get_context("spawn").Event() for _ in range(4)]  # one per rank, see the process body
    results = _run(P.send_returns_before_copies_arrive, 4, 120, big, marks)
    assert not [r for r in results if r[0] == "error"], results
    sent = [r for r in results if r[0] == "sent"]
    assert len(sent) == 2 and all(r[2] == [True, True] for r in sent), sent  # settle waited for both
    got = [r for r in results if r[0] == "received"]
    assert len(got) == 2 and all(r[2] == 1 and r[3] is True for r in got), got
    assert all(r[4] == [True, True] for r in got), got  # both sends returned before this receiver started


def test_a_sender_dying_mid_version_stops_every_peer_within_seconds_and_names_the_bucket():
    results = _run(P.sender_dies, n_results=3)  # rank 1 exits; the three others report
    by_rank = {r[1]: r for r in results}
    assert set(by_rank) == {0, 2, 3}, results
    for rank in (0, 2, 3):
        kind, _, msg, seconds, *rest = by_rank[rank]
        assert kind == "failed", by_rank[rank]
        assert _stopped_by_the_death(msg), (rank, seconds, msg)
        if rank == 0 and "version 3" in msg:  # its own share of version 2 had all arrived before the
            assert "at its header" in msg or "at bucket" in msg, msg  # receivers gave up (seen on 3.12)
        else:
            assert "version 2" in msg and "at bucket" in msg, msg
    for rank in (2, 3):
        msg = by_rank[rank][2]
        assert f"rollout{rank - 2} rank {rank}" in msg, msg
        first_version, half = by_rank[rank][4], by_rank[rank][5]
        assert first_version == 1 and half is None  # the torn version 2 is never handed out
    assert "actor rank 0" in by_rank[0][2]


def test_a_receiver_dying_mid_version_stops_the_senders_within_seconds():
    results = _run(P.receiver_dies, n_results=3)  # rank 3 exits; the three others report
    by_rank = {r[1]: r for r in results}
    assert set(by_rank) == {0, 1, 2}, results  # nobody hangs
    # a sender whose buckets were still to go when rank 3 died fails at once, naming them
    # (buckets already handed to the kernel before it died may have gone through)
    failed = [r for rank, r in by_rank.items() if rank in (0, 1) and r[0] == "failed"]
    assert failed, results
    for _, rank, msg, seconds in failed:
        assert _stopped_by_the_death(msg), (rank, seconds, msg)
        assert f"actor rank {rank}" in msg and "version 1" in msg and "bucket" in msg, msg


def test_a_receiver_that_never_reads_times_out_naming_the_sync():
    import threading

    import torch

    from asyncflow.weight_sync.protocol import make_header
    from asyncflow.weight_sync.send import BucketSender
    from asyncflow.weight_sync.wire_group import WireGroup, open_store

    store, addr = open_store(2, "gloo", "timeout-test", 30, host="127.0.0.1")
    joined: dict = {}
    t = threading.Thread(target=lambda: joined.setdefault("g", WireGroup(addr, 1, 30)))
    t.start()
    group = WireGroup(addr, 0, 2.0, store=store)
    t.join(30)
    sender = BucketSender(0, 0, group, list, timeout_s=2.0)
    sd = {"w": torch.zeros(4 << 20)}  # 16 MB: more than the socket buffers take without a reader
    header = make_header(sd.items(), 1, 1, 1 << 20, 1, None)
    with pytest.raises(RuntimeError, match=r"version 1 .*actor rank 0") as err:
        sender.send(header, list(sd.items()))
    assert "timeout 2 s" in str(err.value) and ("bucket" in str(err.value) or "header" in str(err.value)), err.value
    # the group is out of step now: the sender refuses the next version instead of sending into it
    with pytest.raises(RuntimeError, match="failed before"):
        sender.send(make_header(sd.items(), 2, 2, 1 << 20, 1, None), list(sd.items()))
