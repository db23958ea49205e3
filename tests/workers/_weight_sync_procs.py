"""Process bodies for the weight-sync group tests: 2 FSDP training ranks (0, 1) send to 2
rollout ranks (2, 3) over gloo; each training rank on its own group with both receivers."""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

TRAIN, RECV = [0, 1], [2, 3]
BUCKET = 6000  # bytes: the small net below makes several buckets of it
SEND_RETURN_WAIT_S = 60.0  # receivers wait this long for the senders' sends to return
# Every wait of the syncs (groups, senders, receivers). The deaths tested are seen as closed
# connections, at once; the timeouts only end a broken test, so they leave a loaded machine's
# slow start-up (FSDP set-up before the first version) ample room, below _run's 120 s per result.
SYNC_TIMEOUT_S = 60.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 24)
        self.layers = nn.ModuleList([nn.Linear(24, 24) for _ in range(4)])
        self.norm = nn.LayerNorm(24)
        self.register_buffer("steps", torch.arange(6))


def expected(version: int, cast: torch.dtype | None, net_class: type = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = (net_class or Net)().state_dict()
    out = {}
    for k, v in sd.items():
        v = v * version if v.is_floating_point() else v
        out[k] = v.to(cast) if cast is not None and v.is_floating_point() else v
    return out


def _setup(rank: int, port: int) -> tuple:
    """The world (for FSDP's group and to pass the addresses around), then the weight-sync
    groups: training rank a hosts the store of its group, receivers join as members 1, 2."""
    from asyncflow.weight_sync.wire_group import WireGroup, open_store
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    train = dist.new_group(TRAIN, backend="gloo")
    opened = (open_store(1 + len(RECV), "gloo", f"ws{rank}", SYNC_TIMEOUT_S, host="127.0.0.1")
              if rank in TRAIN else None)
    addrs: list = [None] * 4
    dist.all_gather_object(addrs, opened[1] if opened else None)
    if rank in TRAIN:
        groups = {TRAIN.index(rank): WireGroup(addrs[rank], 0, SYNC_TIMEOUT_S, store=opened[0])}
    else:
        groups = {k: WireGroup(addrs[a], 1 + RECV.index(rank), SYNC_TIMEOUT_S) for k, a in enumerate(TRAIN)}
    return train, groups


class BigNet(Net):
    """Net with a last tensor larger than the sockets' buffers take (8 MB): a sender cannot have
    handed its whole version to the kernel before a receiver reads it, and each training rank's
    rows of it (4 MB) are at least DIRECT_BYTES, so they travel from the shard's own memory."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(1024, 2048, bias=False)


def _sharded(train, net_class: type = Net) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = net_class()
    mesh = DeviceMesh.from_group(train, device_type="cpu")
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _staged(sink):
    """The rollout worker's staged loader: every tensor of the version into ``sink``."""
    def load(header, tensors):
        sink.begin(header)
        for spec, t in tensors:
            sink.tensor(spec, t)
        sink.end(header)
    return load


def _sender(rank: int, groups: dict, gather_all: bool = False):
    from asyncflow.weight_sync.send import BucketSender
    return BucketSender(rank, TRAIN.index(rank), groups[TRAIN.index(rank)], list,
                        timeout_s=SYNC_TIMEOUT_S, train_ranks=TRAIN, gather_all=gather_all)


def _send(net: nn.Module, sender, version: int, cast, die_after: int | None = None):
    """Send a version; ``die_after``: exit the process after that many buckets were packed
    (a sender dying mid-version, buckets already on the wire)."""
    import asyncflow.weight_sync.send as WS
    from asyncflow.weight_sync.protocol import make_header
    from asyncflow.weight_sync.shards import local_tensors
    named = local_tensors(net)
    header = make_header(named, version, version, BUCKET, len(TRAIN), cast)
    if die_after is not None:
        pack, calls = WS.pack_piece, [0]

        def dying(*args):
            calls[0] += 1
            if calls[0] > die_after:
                os._exit(3)
            return pack(*args)
        WS.pack_piece = dying
    stats = sender.send(header, named)
    sender.settle()  # what send left on the wire (the header, copies): the trainer's next publish waits for it
    return header, stats


def sync_two_versions(rank: int, port: int, q, gather_all: bool = False) -> None:
    """v1 in fp32, v2 (weights doubled) cast to bf16: receivers hold exactly the expected
    (BigNet: small tensors travel packed, the large one from and into its own memory).
    gather_all False: each training rank sends its own rows of every split tensor (nothing gathered);
    True: every training rank all-gathers every tensor (as when an instance shares its process)."""
    try:
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.sinks import StagingSink
        train, groups = _setup(rank, port)
        if rank in TRAIN:
            net = _sharded(train, BigNet)
            sender = _sender(rank, groups, gather_all)
            header, s1 = _send(net, sender, 1, None)
            with torch.no_grad():
                for p in net.parameters():
                    p.to_local().mul_(2)
            _, s2 = _send(net, sender, 2, torch.bfloat16)
            q.put(("sent", rank, s1.bytes_sent, s2.bytes_sent, max(s1.peak_extra_bytes, s2.peak_extra_bytes),
                   max(header.bucket_nbytes(b) for b in range(len(header.buckets))), header.nbytes))
        else:
            sink = StagingSink(lambda sd, v: None)
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=SYNC_TIMEOUT_S)
            got = {}
            for v, cast in ((1, None), (2, torch.bfloat16)):
                recv.start(v, _staged(sink), sink.bucket_buffer)
                recv.join()
                header, staged = sink.take()
                want = expected(v, cast, BigNet)
                same = list(staged) == list(want) and all(
                    torch.equal(staged[k], want[k]) and staged[k].dtype == want[k].dtype for k in want)
                got[v] = (header.version, same, recv.bytes_received)
            q.put(("received", rank, got))
        dist.barrier()
    except Exception:  # noqa: BLE001 - reported to the test
        q.put(("error", rank, traceback.format_exc()))


def sender_dies(rank: int, port: int, q) -> None:
    """Training rank 1 exits mid-version; everyone else must fail fast, naming where."""
    start = None
    try:
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.sinks import StagingSink
        train, groups = _setup(rank, port)
        if rank in TRAIN:
            net = _sharded(train)
            sender = _sender(rank, groups)
            _send(net, sender, 1, None)  # a whole version first
            start = time.monotonic()
            _send(net, sender, 2, None, die_after=2 if rank == 1 else None)
            # Rank 0's own share may all have been received (the receivers post buckets ahead)
            # before they gave up on rank 1's: then its next version must fail, as fast.
            _send(net, sender, 3, None)
            q.put(("no-error", rank))
        else:
            sink = StagingSink(lambda sd, v: None)
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=SYNC_TIMEOUT_S)
            load = _staged(sink)
            recv.start(1, load)
            recv.join()
            first = sink.take()
            start = time.monotonic()
            recv.start(2, load)
            try:
                recv.join()
                q.put(("no-error", rank))
            except RuntimeError as e:
                q.put(("failed", rank, str(e), time.monotonic() - start, first[0].version, sink.take()))
    except Exception as e:  # noqa: BLE001 - a training rank's failure is what we look for
        q.put(("failed", rank, str(e), time.monotonic() - start if start else -1.0, None, None))


def receiver_dies(rank: int, port: int, q) -> None:
    """Rollout rank 3 exits mid-version; the senders must fail fast naming where, then exit
    (as a failed run's shutdown ends them), which the other receiver must see at once too."""
    start = None
    try:
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.sinks import StagingSink
        train, groups = _setup(rank, port)
        if rank in TRAIN:
            net = _sharded(train, BigNet)
            sender = _sender(rank, groups)
            start = time.monotonic()
            try:
                _send(net, sender, 1, None)
                q.put(("no-error", rank))
            except RuntimeError as e:
                q.put(("failed", rank, str(e), time.monotonic() - start))
            time.sleep(0.5)
            os._exit(0)
        else:
            sink = StagingSink(lambda sd, v: None)
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=SYNC_TIMEOUT_S)

            def load(header, tensors):
                sink.begin(header)
                for i, (spec, t) in enumerate(tensors):
                    if rank == 3 and i == 4:
                        os._exit(3)
                    sink.tensor(spec, t)
                sink.end(header)
            start = time.monotonic()
            recv.start(1, load)
            try:
                recv.join()
                q.put(("no-error", rank))
            except RuntimeError as e:
                q.put(("failed", rank, str(e), time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put(("failed", rank, f"outside the sync: {e}", time.monotonic() - start if start else -1.0))


def send_returns_before_copies_arrive(rank: int, port: int, q, big: bool = False, marks: list = ()) -> None:
    """The receivers start receiving only once both senders' ``send`` returned (``marks[rank]``,
    one multiprocessing Event per rank, set by a sender when its send returned and by a receiver
    when it starts). A version of small tensors in one bucket (every message a packed copy,
    within max_inflight) leaves ``send`` without a receiver; with ``big`` (BigNet: its large
    tensor sent from its own memory) so does a send with ``wait_direct=False``. ``settle``
    returns once the receivers have it, so after both receivers started; the weights then
    change (as an optimizer step after the actor's settle), and the receivers still hold
    exactly the version sent."""
    try:
        from asyncflow.weight_sync.protocol import make_header
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.shards import local_tensors
        from asyncflow.weight_sync.sinks import StagingSink
        net_class = BigNet if big else Net
        train, groups = _setup(rank, port)
        if rank in TRAIN:
            net = _sharded(train, net_class)
            sender = _sender(rank, groups)
            named = local_tensors(net)
            header = make_header(named, 1, 1, 2**23, len(TRAIN), None)  # one bucket: within max_inflight
            sender.send(header, named, wait_direct=not big)
            marks[rank].set()
            sender.settle()
            receivers_started = [marks[r].is_set() for r in RECV]
            with torch.no_grad():
                for p in net.parameters():
                    p.to_local().mul_(2)
            q.put(("sent", rank, receivers_started))
        else:
            sink = StagingSink(lambda sd, v: None)
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=SYNC_TIMEOUT_S)
            # A send that waited for a receiver never returns here: the wait runs out instead.
            senders_returned = [marks[r].wait(SEND_RETURN_WAIT_S) for r in TRAIN]
            marks[rank].set()
            recv.start(1, _staged(sink), sink.bucket_buffer)
            recv.join()
            header, staged = sink.take()
            want = expected(1, None, net_class)
            q.put(("received", rank, header.version,
                   list(staged) == list(want) and all(torch.equal(staged[k], want[k]) for k in want),
                   senders_returned))
        dist.barrier()
    except Exception:  # noqa: BLE001 - reported to the test
        q.put(("error", rank, traceback.format_exc()))
