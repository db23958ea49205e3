"""The TransferQueue requests of one RL step, small rows: CPU per step of the client and the service.

The control plane's cost at bench_e2e's work is its requests, each a few small columns, not
its bytes (perf/cpu_account.py). This benchmark replays one step's TransferQueue traffic in
GRPO's order, from one blocking client to a TransferQueue service process (controller and one
storage unit, the launcher's default), ``--rows`` rows a step (64: bench_e2e at x1):

  the prompts put into a new partition (created by that put, as the executor does, or by a
  create_partition request first with ``--separate-create``, as earlier code did); the rollout
  reads them (get_batch) and puts its columns; the reference reads prompt and response
  (get_meta, then a read) and puts its log-probs; the advantages read scores and responses
  (get_batch) and put theirs; the update reads its columns (get_batch); the step is cleared.

It reports CPU milliseconds per step of this process (the client: encoding, MACs, sockets,
replies) and of the service process (from /proc), and the requests a step. No sleeps, no
timers: the figures are CPU, so a loaded machine moves them less than wall times, but still;
compare codes in turns (``PYTHONPATH=<checkout> python perf/bench_tq_step.py``). The last
line printed is one JSON object.

    python perf/bench_tq_step.py [--steps 400] [--rows 64] [--separate-create]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncflow.transfer_queue import TransferQueueClient
from asyncflow.transfer_queue.columns import JaggedColumn
from asyncflow.transfer_queue.service import TransferQueueConfig
from asyncflow.transfer_queue.service_process import ServiceProcess

try:  # absent from code before edb2e58, which this benchmark also runs (--separate-create)
    from asyncflow.transfer_queue import NewPartition
    HAS_CREATE = True
except ImportError:
    HAS_CREATE = False

GROUP = 4


def jagged(rows: int, length: int, dtype: torch.dtype, seed: int) -> JaggedColumn:
    """``rows`` rows of ``length`` values each, as one column (what the workers put)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(rows + 1, dtype=torch.long) * length
    values = (torch.randint(0, 30, (rows * length,), generator=g) if dtype == torch.long
              else torch.randn(rows * length, generator=g)).to(dtype)
    return JaggedColumn(values, offsets)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step(c: TransferQueueClient, t: int, rows: int, separate_create: bool) -> int:
    """One step's TransferQueue traffic; returns the requests it made."""
    p, group = f"step{t}", {"name": "grpo_group", "group_size": GROUP}
    prompts = {"prompt_ids": jagged(rows, 8, torch.long, t), "seed": torch.arange(rows),
               "answer": [str(i) for i in range(rows)], "prompt": [f"{i}+{i}=" for i in range(rows)],
               "metadata": [{"i": i} for i in range(rows)]}
    groups = [i // GROUP for i in range(rows)]
    if separate_create:
        c.create_partition(p, close_at=rows)
        c.put(prompts, p, groups=groups)
    else:
        c.put(prompts, p, groups=groups, create=NewPartition(close_at=rows))
    meta, _ = c.get_batch_columns(["prompt_ids", "seed", "answer", "prompt", "metadata"], rows, "rollout", p, group)
    c.put({"response_ids": jagged(rows, 4, torch.long, t + 1), "behav_log_probs": jagged(rows, 4, torch.float32, t),
           "token_versions": jagged(rows, 4, torch.float32, t), "gen_version": torch.zeros(rows, dtype=torch.long),
           "scores": torch.rand(rows)}, p, meta)
    meta = c.get_meta(["prompt_ids", "response_ids"], rows, "ref", p, group)
    c.get_columns(meta, ["prompt_ids", "response_ids"])
    c.put({"ref_log_probs": jagged(rows, 4, torch.float32, t + 2)}, p, meta)
    meta, _ = c.get_batch_columns(["scores", "response_ids"], rows, "advantages", p, group)
    c.put({"advantages": jagged(rows, 4, torch.float32, t + 3)}, p, meta)
    update = ["prompt_ids", "response_ids", "advantages", "behav_log_probs", "scores", "gen_version", "token_versions",
              "ref_log_probs"]
    c.get_batch_columns(update, rows, "update", p, {"name": "token_balanced", "dp_size": 1})
    c.clear(p)
    return 11 + separate_create


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="timed steps (after --warmup untimed ones)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rows", type=int, default=64, help="rows a step (a multiple of 4, the group size)")
    ap.add_argument("--separate-create", action="store_true",
                    help="create each step's partition with a request of its own (the executor before edb2e58)")
    a = ap.parse_args(argv)
    if a.rows < GROUP or a.rows % GROUP:
        ap.error(f"--rows must be a positive multiple of {GROUP} (whole groups), got {a.rows}")
    if not HAS_CREATE and not a.separate_create:
        ap.error("this code's TransferQueue cannot create a partition with a put: run with --separate-create")
    service = ServiceProcess(TransferQueueConfig())
    client = TransferQueueClient(service.controller_address)
    try:
        for t in range(a.warmup):
            step(client, t, a.rows, a.separate_create)
        s0, c0, w0 = process_cpu_s(service.pid), time.process_time(), time.monotonic()
        requests = sum(step(client, t, a.rows, a.separate_create) for t in range(a.warmup, a.warmup + a.steps))
        s1, c1, w1 = process_cpu_s(service.pid), time.process_time(), time.monotonic()
    finally:
        client.close()
        service.stop_in_thread()
    out = {"rows": a.rows, "steps": a.steps, "requests_per_step": requests / a.steps,
           "client_cpu_ms_per_step": round(1e3 * (c1 - c0) / a.steps, 3),
           "service_cpu_ms_per_step": round(1e3 * (s1 - s0) / a.steps, 3),
           "wall_ms_per_step": round(1e3 * (w1 - w0) / a.steps, 3), "separate_create": a.separate_create}
    print(f"{a.rows} rows a step, {out['requests_per_step']:.0f} requests: client {out['client_cpu_ms_per_step']:.2f} "
          f"ms CPU, service {out['service_cpu_ms_per_step']:.2f} ms CPU, wall {out['wall_ms_per_step']:.2f} ms a step")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
