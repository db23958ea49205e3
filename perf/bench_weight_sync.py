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
    python perf/bench_weight_sync.py --lora [RANK] [--quick] [--mb 128] [--rounds 5] [--train-steps 3]

``--lora``: full fine-tuning against LoRA on the same model, each in its own 4 processes:
the training ranks hold the trainer's FSDPEngine (a Qwen2 of about ``--mb`` MB), train
``--train-steps`` steps, then send versions as the actor does (ActorWorker._sync_tensors):
every tensor (full); the adapters only after the first version (LoRA, the built-in engine);
the merged weights (LoRA, vLLM). Per version: bytes and median seconds. Trainer memory: each
training rank's resident-set high-water mark (VmHWM, reset after the engine's build) over
the training steps, above its resident set before the build (so: its parameters, gradients,
optimizer state and activations); glibc is told to return every allocation
of 64 KiB or more on free, so the resident set follows the live tensors. Also printed: each
rank's parameters + gradients + optimizer state, counted from the tensors, and PROJECTED
bytes per version and actor memory for Qwen2.5-7B/32B from asyncflow.planning. Its last line
is one JSON object (full, lora, the ratios full / LoRA, adapters_equal_adapter_bytes).

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
# their config.json files' shapes (Hugging Face model repositories), for asyncflow.planning's counts
QWEN25_CONFIGS = {
    "Qwen2.5-7B": {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "Qwen2.5-32B": {"model_type": "qwen2", "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False},
}
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


def _init_world(rank: int, port: int):
    """The 4-process gloo world; returns the training ranks' group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=300))
    return dist.new_group(TRAIN, backend="gloo")


def _wire_groups(rank: int) -> dict:
    """The weight-sync groups as the trainer makes them: training rank a hosts its group's
    store and is member 0; the instances join as members 1 and 2. Keyed by training rank index."""
    import torch.distributed as dist

    from asyncflow.weight_sync.wire_group import WireGroup, open_store

    opened = open_store(1 + len(RECV), "gloo", f"bench{rank}", 300, host="127.0.0.1") if rank in TRAIN else None
    addrs: list = [None] * 4
    dist.all_gather_object(addrs, opened[1] if opened else None)
    if rank in TRAIN:
        return {TRAIN.index(rank): WireGroup(addrs[rank], 0, 300, store=opened[0])}
    return {k: WireGroup(addrs[a], 1 + RECV.index(rank), 300) for k, a in enumerate(TRAIN)}


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

        torch.set_num_threads(1)
        train = _init_world(rank, port)
        groups = _wire_groups(rank)
        net = _model(mb)
        if rank in TRAIN:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard
            mesh = DeviceMesh.from_group(train, device_type="cpu")
            for layer in net.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            index = TRAIN.index(rank)
            sender = BucketSender(rank, index, groups[index], list, timeout_s=300, train_ranks=TRAIN,
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


# ---------------------------------------------------------------------------- --lora
# The same 4-process world, but the training ranks hold the trainer's own engine (FSDPEngine,
# a Qwen2 of about --mb megabytes), once training every weight and once LoRA adapters, each
# in fresh processes so that neither run's memory shows in the other's.
LORA_VARIANTS = {"full": ("full",), "lora": ("adapters", "merged")}
# glibc returns every allocation of this size or more to the system when it is freed (and
# does not raise the threshold as it otherwise does), so the resident set follows the live
# tensors and its high-water mark is the trainer's peak.
MMAP_THRESHOLD = 1 << 16


def qwen2_config(mb: float) -> dict:
    """A Qwen2 config.json of about ``mb`` megabytes of fp32 parameters (whole layers; at least one)."""
    from asyncflow.planning import ModelShape, count_params

    cfg = {"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408,
           "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False,
           "max_position_embeddings": 256, "num_hidden_layers": 1}
    count = count_params(ModelShape.from_config(cfg))
    fixed = count.total - count.per_layer
    cfg["num_hidden_layers"] = max(1, round((mb * 2**20 / 4 - fixed) / count.per_layer))
    return cfg


def status_kb(text: str, key: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/<pid>/status, in kB."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(f"{key} not in /proc status")


def _rss_kb(key: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return status_kb(f.read(), key)


def _reset_peak_rss() -> None:
    """Start the resident set's high-water mark (VmHWM) again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _state_bytes(engine) -> int:
    """This rank's parameters, gradients and optimizer state, from the tensors themselves."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = list(engine.model.parameters())
    n = sum(local(p).numel() * p.element_size() for p in params)
    n += sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    return n + sum(local(v).numel() * v.element_size() for st in engine.optimizer.state.values()
                   for v in st.values() if hasattr(v, "dim") and v.dim() > 0)


def _batch(rank: int, rows: int = 8, prompt: int = 16, response: int = 48):
    import torch
    g = torch.Generator().manual_seed(rank)
    return ([torch.randint(0, 8192, (prompt,), generator=g) for _ in range(rows)],
            [torch.randint(0, 8192, (response,), generator=g) for _ in range(rows)])


def _lora_child(rank: int, port: int, mode: str, cfg: dict, lora_rank: int, bucket_mb: float, rounds: int,
                steps: int, q) -> None:
    try:
        import types

        import torch
        import torch.distributed as dist
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from asyncflow.weight_sync.protocol import make_header
        from asyncflow.weight_sync.receive import BucketReceiver
        from asyncflow.weight_sync.send import BucketSender
        from asyncflow.weight_sync.sinks import StagingSink

        torch.set_num_threads(1)
        train = _init_world(rank, port)
        groups = _wire_groups(rank)
        variants = LORA_VARIANTS[mode]
        out: dict = {"rank": rank}
        if rank in TRAIN:
            from asyncflow.engines.train import FSDPEngine, OptimConfig
            from asyncflow.engines.train.lora import LoraOptions, is_adapter
            from asyncflow.platform import get_platform
            from asyncflow.weight_sync.shards import local_tensors
            from asyncflow.workers.actor import ActorWorker
            from asyncflow.workers.actor_loss import sft_loss_fn

            def model():
                torch.manual_seed(0)
                return Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"},
                                                    attn_implementation="eager"))
            lora = LoraOptions(rank=lora_rank) if mode == "lora" else None
            before_build = _rss_kb()
            engine = FSDPEngine(model, OptimConfig(lr=1e-4), process_group=train, platform=get_platform("cpu"),
                                **({"lora": lora} if lora else {}))
            prompts, responses = _batch(rank)
            dist.barrier(train)
            after_build = _rss_kb()
            _reset_peak_rss()  # the build's transient (rank 0 builds the whole model) is not training
            for _ in range(steps):
                engine.train_step(prompts, responses, {}, sft_loss_fn, temperature=1.0)
            out.update(peak_kb=_rss_kb("VmHWM"), before_build_kb=before_build, after_build_kb=after_build,
                       state_bytes=_state_bytes(engine))
            out["adapter_bytes"] = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
                                       if is_adapter(n))  # global shapes: every rank's share together
            index = TRAIN.index(rank)
            sender = BucketSender(rank, index, groups[index], list, timeout_s=300, train_ranks=TRAIN,
                                  gather_all=False)
            actor = {v: types.SimpleNamespace(lora=lora, engine=engine, lora_sync=v, _merged=None) for v in variants}
        else:
            sinks = {v: StagingSink(lambda sd, ver: None) for v in variants}
            recv = BucketReceiver(rank, f"rollout{rank - 2}", TRAIN, groups, timeout_s=300)

        def one_version(variant: str, v: int) -> tuple[float, int, float]:
            """Seconds and bytes of version ``v``: the actor's choice of tensors (ActorWorker._sync_tensors,
            merging included), sent and received; and the seconds of that choice alone (this rank's)."""
            dist.barrier()
            start = time.perf_counter()
            nbytes, select_s = 0, 0.0
            if rank in TRAIN:
                named = ActorWorker._sync_tensors(actor[variant], local_tensors(engine.model))
                select_s = time.perf_counter() - start
                h = make_header(named, v, v, int(bucket_mb * 2**20), len(TRAIN), None)
                sender.send(h, named)
                sender.settle()
                nbytes = h.nbytes
            else:
                sink = sinks[variant]

                def load(h, tensors):
                    sink.begin(h)
                    for spec, t in tensors:
                        sink.tensor(spec, t)
                    sink.end(h)
                recv.start(v, load, sink.bucket_buffer)
                recv.join()
                assert sink.take()[0].version == v
            dist.barrier()
            return time.perf_counter() - start, nbytes, select_s

        # the first version of LoRA carries the base too (ActorWorker._sync_tensors): one untimed
        # version of each variant first, so the timed ones are the steady state
        first = {var: one_version(var, 1 + i)[1] for i, var in enumerate(variants)}
        seconds: dict = {var: [] for var in variants}
        select: dict = {var: [] for var in variants}
        nbytes: dict = {var: set() for var in variants}
        v = 1 + len(variants)
        for r in range(rounds):
            for var in variants[r % len(variants):] + variants[:r % len(variants)]:
                s_, b_, sel = one_version(var, v)
                v += 1
                seconds[var].append(s_)
                select[var].append(sel)
                nbytes[var].add(b_)
        if rank in TRAIN:
            out.update(seconds=seconds, select_seconds=select, first_bytes=first,
                       bytes={k: sorted(b) for k, b in nbytes.items()})
            q.put(out)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        q.put({"error": rank, "trace": traceback.format_exc()})


def _measure_mode(mode: str, cfg: dict, lora_rank: int, bucket_mb: float, rounds: int, steps: int) -> dict:
    import os

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the children's glibc reads it at start
    try:
        procs = [ctx.Process(target=_lora_child, args=(r, port, mode, cfg, lora_rank, bucket_mb, rounds, steps, q),
                             daemon=True) for r in range(4)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    got = [q.get(timeout=900) for _ in range(len(TRAIN))]
    for p in procs:
        p.join(timeout=60)
    errors = [g for g in got if "error" in g]
    if errors:
        raise RuntimeError(f"bench_weight_sync --lora ({mode}): rank {errors[0]['error']} failed:\n"
                           f"{errors[0]['trace']}")
    return summarize_mode(sorted(got, key=lambda g: g["rank"]))


def summarize_mode(ranks: list[dict]) -> dict:
    """One mode's figures from its training ranks' reports: per sync variant the bytes of a
    version and the median seconds (rank 0's clock), and the trainer's memory."""
    r0 = ranks[0]
    out: dict = {}
    for var, secs in r0["seconds"].items():
        sizes = r0["bytes"][var]
        if len(sizes) != 1:
            raise ValueError(f"{var}: versions of different sizes {sizes}; the steady state sends the same tensors")
        out[var] = {"bytes_per_version": sizes[0], "first_version_bytes": r0["first_bytes"][var],
                    "sync_s": round(statistics.median(secs), 4), "sync_s_all": [round(s, 4) for s in secs],
                    # building the version's tensors (the merge, for vLLM) on the slower training rank
                    "select_s": round(max(statistics.median(g["select_seconds"][var]) for g in ranks), 4)}
    out["trainer_peak_mb_by_rank"] = [round((g["peak_kb"] - g["before_build_kb"]) / 1024, 1) for g in ranks]
    out["trainer_after_build_mb_by_rank"] = [round((g["after_build_kb"] - g["before_build_kb"]) / 1024, 1)
                                             for g in ranks]
    out["trainer_state_mb_by_rank"] = [round(g["state_bytes"] / 2**20, 2) for g in ranks]
    out["adapter_bytes"] = r0["adapter_bytes"]
    return out


def lora_projection_rows(lora_rank: int, devices: int = 8) -> list[dict]:
    """Qwen2.5-7B and 32B with and without rank-``lora_rank`` adapters, from asyncflow.planning:
    bytes of one bf16 version and the actor's persistent memory per device (parameters,
    gradients, optimizer state, sharded over ``devices``; the planner's default training dtypes)."""
    from asyncflow.planning import ModelShape, count_params
    from asyncflow.planning.memory import actor_memory
    from asyncflow.planning.params import lora_params
    from asyncflow.planning.settings import TrainSettings

    rows = []
    for name, config in QWEN25_CONFIGS.items():
        shape = ModelShape.from_config(config)
        params = count_params(shape)
        for label, r in (("full", 0), (f"lora r={lora_rank}", lora_rank)):
            mem = actor_memory(shape, params, TrainSettings(lora_rank=r), devices)
            synced = lora_params(shape, r) if r else params.total
            rows.append({"model": name, "training": label, "sync_bytes": synced * 2,
                         "actor_state_bytes_per_device": mem.weights + mem.gradients + mem.optimizer})
    return rows


def lora_projection_lines(lora_rank: int, devices: int = 8) -> list[str]:
    lines = [(f"PROJECTED (not measured, asyncflow.planning): one bf16 version over one link (bytes / link speed), "
              f"and the actor's weights (with FSDP's gather buffers) + gradients + AdamW state per device over "
              f"{devices} devices"),
             f"{'model':<13}{'training':<11}{'version':>11}" + "".join(f"{f'{g} GB/s':>11}" for g in LINKS_GBPS)
             + f"{'actor GiB/dev':>15}"]
    for row in lora_projection_rows(lora_rank, devices):
        b = row["sync_bytes"]
        size = f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"
        lines.append(f"{row['model']:<13}{row['training']:<11}{size:>11}"
                     + "".join(f"{b / (g * 1e9) * 1e3:>9.1f}ms" for g in LINKS_GBPS)
                     + f"{row['actor_state_bytes_per_device'] / 2**30:>15.1f}")
    return lines


def lora_lines(out: dict) -> list[str]:
    """The measured table of --lora."""
    f, lo = out["full"], out["lora"]
    lines = [(f"MEASURED: Qwen2 of {out['model_mb']} MB fp32 ({out['model_layers']} layers), 2 training ranks "
              f"(FSDP2), 2 rollout receivers, gloo; LoRA rank {out['lora_rank']}"),
             f"{'sync':<22}{'bytes/version':>15}{'s/version':>11}{'of which build':>16}{'trainer peak MB':>17}"]
    rows = [("full", f["full"], f), ("lora adapters", lo["adapters"], lo), ("lora merged (vLLM)", lo["merged"], lo)]
    for name, entry, mode in rows:
        lines.append(f"{name:<22}{entry['bytes_per_version']:>15,}{entry['sync_s']:>11.4f}{entry['select_s']:>16.4f}"
                     f"{max(mode['trainer_peak_mb_by_rank']):>17.1f}")
    return lines


def measure_lora(mb: float = 64.0, lora_rank: int = 8, bucket_mb: float = 64.0, rounds: int = 5,
                 steps: int = 3) -> dict:
    """Full fine-tuning against LoRA on the same model: bytes and seconds per version, the
    trainer's peak resident memory; each mode in its own 4 processes."""
    cfg = qwen2_config(mb)
    full = _measure_mode("full", cfg, lora_rank, bucket_mb, rounds, steps)
    lora = _measure_mode("lora", cfg, lora_rank, bucket_mb, rounds, steps)
    return lora_summary(full, lora, cfg, lora_rank, bucket_mb, rounds, steps)


def lora_summary(full: dict, lora: dict, cfg: dict, lora_rank: int, bucket_mb: float, rounds: int,
                 steps: int) -> dict:
    """The --lora last line: both modes and the ratios full / LoRA."""
    def peak(mode: dict) -> float:
        return max(mode["trainer_peak_mb_by_rank"])
    f, a = full["full"], lora["adapters"]
    return {"lora_rank": lora_rank, "model_layers": cfg["num_hidden_layers"],
            "model_mb": round(f["bytes_per_version"] / 2**20, 1), "bucket_mb": bucket_mb, "rounds": rounds,
            "train_steps": steps,
            "memory_measure": "each training rank's VmHWM over its train steps (reset after the engine's build) "
                              "minus its VmRSS before the build; glibc mmap threshold 64 KiB; max over ranks",
            "full": full, "lora": lora,
            "adapters_equal_adapter_bytes": a["bytes_per_version"] == lora["adapter_bytes"],
            "ratio_bytes_full_vs_lora": round(f["bytes_per_version"] / a["bytes_per_version"], 1),
            "ratio_sync_s_full_vs_lora": round(f["sync_s"] / a["sync_s"], 2),
            "ratio_sync_s_full_vs_lora_merged": round(f["sync_s"] / lora["merged"]["sync_s"], 2),
            "trainer_peak_mb_full": peak(full), "trainer_peak_mb_lora": peak(lora),
            "ratio_trainer_peak_full_vs_lora": round(peak(full) / max(peak(lora), 1e-9), 2)}


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
    ap.add_argument("--bucket-mb", type=float, default=64.0,
                    help="the sync's buckets (weight_sync.bucket_mb's default)")
    ap.add_argument("--raw-bucket-mb", default=",".join(str(x) for x in RAW_BUCKET_MB),
                    help="bucket sizes raw is measured at (besides --bucket-mb); the fastest is the headline's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-inflight", type=int, default=1, help="weight_sync.max_inflight of the senders")
    ap.add_argument("--lora", type=int, nargs="?", const=8, default=None, metavar="RANK",
                    help="full fine-tuning against LoRA adapters of this rank (8 if none given) on the same model")
    ap.add_argument("--train-steps", type=int, default=3, help="--lora: training steps the trainer's peak covers")
    a = ap.parse_args()
    mb, rounds = (64.0, 5) if a.quick else (a.mb, a.rounds)
    if a.lora is not None:
        out = measure_lora(mb, a.lora, a.bucket_mb, rounds, a.train_steps)
        for line in lora_lines(out) + lora_projection_lines(a.lora):
            print(line)
        print(json.dumps(out))
        return
    out = measure(mb, a.bucket_mb, rounds, a.max_inflight, tuple(float(x) for x in a.raw_bucket_mb.split(",") if x))
    for line in projections(out["ratio_sync_vs_raw"]):
        print(line)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
