"""Discrete-event simulation of the AsyncFlow workflow at 1x..16x cluster size.

The paper reports near-linear scaling (efficiency 0.65-0.88) over a 16x larger cluster.
We cannot run 1024 devices, so this script replays the workflow of
``asyncflow/workflow/executor.py`` in a discrete-event simulation whose per-stage costs
are MEASURED on this machine and scaled by a small, stated cost model. The question it
answers: does the single TransferQueue controller (in-process, on the driver's asyncio
loop) become the critical path at 16x? (DESIGN.md: split the controller per task when
the simulation shows it there.)

MEASURED (from a run's ``timeline.jsonl``, ``samples.jsonl`` and ``config.json``: the
run given with ``--from-run OUT_DIR``, or a short run this script starts itself):
  - rollout call time vs rows (least squares: fixed cost per call + cost per row; the
    median per row when rows do not vary), turned into a cost per padded token with the
    run's longest response;
  - reward call time vs rows, update time vs rows (per training device);
  - weight sync: the actor's publish (gather + pack, median) and one instance's receive;
    with the exported model's size this gives the sync bandwidth. Spans are timed at the
    driver, so they include waiting behind other calls on the same rank (reward behind the
    update on rank 0, a receive behind the running generate): for these short calls the
    fastest span is taken as the cost;
  - the share of generated rows that train (dynamic sampling) and the mean response length.
The controller's cost is a PARAMETER, defaulted from perf/RESULTS.md
(perf/bench_transfer_queue.py): get_meta ~1 ms per call at 16 rows (taken whole as
service time, though most of it is the client's round trip: pessimistic), ~0.5 ms
bookkeeping per 1024 rows, ~0.3 ms per put notification; the driver's RPC dispatch,
0.42 ms per worker call (perf/bench_rpc.py), runs on the same asyncio loop and is charged
to it too. Latency that grows with concurrent clients is reproduced by queueing (one FIFO
server); ``--ctrl-client-ms`` adds an extra per-connected-client cost as a what-if.

MODELLED (assumptions, not measurements):
  - a device is one measured rank; a rollout instance is ``--devices-per-instance``
    devices and runs that many times faster (perfect tensor parallelism);
  - rollout of a batch of B rows costs ``call + tok * B * max(L)`` (static batching: the
    longest response holds the batch); response lengths are long-tailed, lognormal with
    the measured mean, ``--len-sigma`` and a cap of ``--len-cap`` times the mean
    (the tiny task's own lengths barely vary; real reasoning traces do);
  - reward runs next to each instance (its own lane, overlapping the next generation);
  - the update on D training devices costs ``call + row * rows / D`` plus a ring
    all-reduce of the gradients, ``2 (D-1)/D * bytes / --coll-gbps``;
  - after each update the actor publishes (busy ``publish_s``), then the weights go to the
    instances in turn over ``--sync-links`` parallel links (default: one per training
    device; the code today has one sender, ``--sync-links 1``), each transfer
    ``bytes / bandwidth``; only the newest version is sent to an instance that is behind;
    an instance swaps at its next generation boundary;
  - sync: the step is split over the instances, one call each, and rollout of step t
    waits for version t; async: instances pull ``--batch-prompts`` prompts at a time
    (fewer when the step has fewer than that per instance), needing version >= t - k;
  - weak scaling: prompts per step grow with the cluster; strong: fixed. Throughput is
    rows trained per second between the end of step ``warm`` and the last step. Under
    strong scaling the static-batching model lets smaller batches hold less padding, so
    async can come out slightly superlinear (> 1): an artefact of that model;
  - ``--controllers per_task``: one controller per task (rollout, reward, update), each put
    notified to all of them (DESIGN.md's split); the driver keeps the RPC dispatch.

    python perf/simulate_scale.py [--from-run outputs/run] [--base-devices 48] [--quick]

Pure Python, seeded, seconds. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 4, 8, 16)


# ---- configuration ---------------------------------------------------------------------------

@dataclass
class Costs:
    """Per-stage costs on one device (seconds), measured or given."""
    rollout_call_s: float = 0.05  # fixed cost of one generate call
    rollout_tok_s: float = 5e-4  # per padded token (row x longest response of the batch)
    reward_call_s: float = 0.005
    reward_row_s: float = 1e-4
    update_call_s: float = 0.05
    update_row_s: float = 4e-3  # per trained row on ONE training device
    publish_s: float = 0.02  # actor: gather full weights to host + pack
    swap_s: float = 0.0  # instance: swap staged weights in (measured inside the rollout call)
    model_bytes: float = 2e6
    sync_gbps: float = 0.2  # one weight-sync link, GB/s
    coll_gbps: float = 25.0  # gradient all-reduce bandwidth (modelled)
    len_mean: float = 8.0  # mean response tokens (measured)
    len_sigma: float = 0.9  # lognormal sigma of response lengths (modelled long tail)
    len_cap: float = 5.0  # response lengths capped at len_cap * len_mean
    accept: float = 1.0  # share of generated rows that train (dynamic sampling)
    # the driver's asyncio loop (controller in process) -- parameters, see the docstring
    ctrl_get_s: float = 1.0e-3  # get_meta, per call
    ctrl_row_s: float = 0.5e-3 / 1024  # get_meta bookkeeping per row
    ctrl_put_s: float = 0.3e-3  # put notification
    ctrl_client_s: float = 0.0  # what-if: extra cost per connected client per call
    rpc_s: float = 0.42e-3  # driver-side dispatch of one worker call
    work_scale: float = 1.0  # what-if: multiply rollout/update compute
    source: str = "defaults"


@dataclass
class SimConfig:
    devices: int = 3
    rollout_share: float = 2 / 3  # rollout : train = 2 : 1
    devices_per_instance: int = 1
    mode: str = "async"  # sync | async
    max_staleness: int = 1
    prompts_per_step: int = 32
    group_size: int = 8
    batch_prompts: int = 16  # async: prompts per rollout call
    steps: int = 12
    warm: int = 2  # steps left out of the throughput window
    sync_links: int = 0  # parallel weight-sync links; 0: one per training device
    controllers: str = "single"  # single (in the driver's loop) | per_task (own process each)
    seed: int = 0
    costs: Costs = field(default_factory=Costs)

    @property
    def rollout_devices(self) -> int:
        d = self.devices_per_instance
        return max(d, int(round(self.devices * self.rollout_share / d)) * d)

    @property
    def instances(self) -> int:
        return self.rollout_devices // self.devices_per_instance

    @property
    def train_devices(self) -> int:
        return max(1, self.devices - self.rollout_devices)

    @property
    def lag(self) -> int:
        return self.max_staleness if self.mode == "async" else 0


@dataclass
class SimResult:
    throughput: float  # rows trained per second (steady window)
    step_end: list[float]
    rows_trained: list[float]
    makespan: float
    ctrl_busy_share: float  # busiest control-plane server, busy / window
    driver_busy_share: float  # the driver's loop (RPC dispatch, and the controller when single)
    ctrl_wait_ms: float  # mean queueing delay per control-plane request
    rollout_util: float
    train_util: float
    sync_s_per_version: float
    instances: int
    train_devices: int
    calls: int


# ---- the engine -------------------------------------------------------------------------------

class _Server:
    """One FIFO server with known service times: a request's end is known when it arrives."""

    def __init__(self, name: str):
        self.name = name
        self.free_at = 0.0
        self.spans: list[tuple[float, float]] = []
        self.wait = 0.0
        self.n = 0

    def request(self, now: float, cost: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + cost
        self.wait += start - now
        self.n += 1
        if cost > 0:
            self.spans.append((start, self.free_at))
        return self.free_at

    def busy_in(self, a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in self.spans)


def _busy_in(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)


class _Step:
    __slots__ = ("rows", "unassigned", "done", "issued")

    def __init__(self, rows: int):
        self.rows = rows
        self.unassigned = rows
        self.done = 0
        self.issued = False


class _Run:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.c = cfg.costs
        self.rng = random.Random(cfg.seed)
        self.q: list = []
        self.seq = 0
        self.now = 0.0
        K = cfg.instances
        self.K = K
        self.D = cfg.train_devices
        self.links = cfg.sync_links or self.D
        self.rows_per_step = cfg.prompts_per_step * cfg.group_size
        g = cfg.group_size
        if cfg.mode == "sync":  # the step split over the instances (executor._batch)
            share = -(-self.rows_per_step // K)
            self.call_rows = -(-share // g) * g
        else:
            per_inst = max(1, cfg.prompts_per_step // K)
            self.call_rows = min(cfg.batch_prompts, per_inst) * g
        # control plane: the driver's loop; with per_task controllers each task has its own
        self.driver = _Server("driver")
        self.ctrl: dict[str, _Server] = {}
        tasks = ("rollout", "reward", "update")
        clients = {"rollout": K, "reward": K, "update": 1}
        if cfg.controllers == "per_task":
            for t in tasks:
                self.ctrl[t] = _Server(f"controller[{t}]")
            self.clients = clients
        elif cfg.controllers == "single":
            for t in tasks:
                self.ctrl[t] = self.driver
            self.clients = {t: K * 2 + 2 for t in tasks}  # every client talks to the one controller
        else:
            raise ValueError(f"controllers: expected single or per_task, got {cfg.controllers!r}")
        self.steps: dict[int, _Step] = {}
        self.next_issue = 0
        self.actor_version = 0
        self.actor_free = 0.0
        self.actor_spans: list[tuple[float, float]] = []
        self.next_update = 0
        self.updating = False
        self.inst_version = [0] * K  # staged (received)
        self.inst_held = [0] * K  # swapped in
        self.inst_busy = [False] * K
        self.inst_spans: list[float] = [0.0] * K
        self.reward_free = [0.0] * K
        self.published = 0  # newest published version
        self.sending: set[int] = set()
        self.link_free = [0.0] * self.links
        self.sync_rr = 0
        self.sync_times: list[float] = []
        self.step_end: dict[int, float] = {}
        self.trained: dict[int, float] = {}
        self.calls = 0
        self._mu = math.log(max(self.c.len_mean, 1e-9)) - self.c.len_sigma ** 2 / 2

    # -- events
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.q, (t, self.seq, fn))
        self.seq += 1

    def run(self) -> None:
        self.try_issue()
        while self.q:
            t, _, fn = heapq.heappop(self.q)
            self.now = t
            fn()

    # -- control plane
    def get_meta(self, task: str, rows: int, now: float) -> float:
        c = self.c
        cost = c.ctrl_get_s + c.ctrl_row_s * rows + c.ctrl_client_s * self.clients[task]
        return self.ctrl[task].request(now, cost)

    def put(self, task: str, now: float) -> float:
        c = self.c
        cost = c.ctrl_put_s + c.ctrl_client_s * self.clients[task]
        servers = {id(s): s for s in self.ctrl.values()}.values()  # broadcast to every controller
        return max(s.request(now, cost) for s in servers)

    def rpc(self, now: float) -> float:
        return self.driver.request(now, self.c.rpc_s) if self.c.rpc_s > 0 else now

    # -- cost model
    def max_len(self, rows: int) -> float:
        c = self.c
        if c.len_sigma <= 0:
            return c.len_mean
        u = self.rng.random() ** (1.0 / rows)  # the largest of `rows` uniform draws
        u = min(max(u, 1e-12), 1 - 1e-12)
        z = statistics.NormalDist().inv_cdf(u)
        return max(1.0, min(c.len_cap * c.len_mean, math.exp(self._mu + c.len_sigma * z)))

    def rollout_s(self, rows: int) -> float:
        c, d = self.c, self.cfg.devices_per_instance
        return c.rollout_call_s + c.rollout_tok_s * rows * self.max_len(rows) * c.work_scale / d

    def reward_s(self, rows: int) -> float:
        return self.c.reward_call_s + self.c.reward_row_s * rows

    def update_s(self, rows: float) -> float:
        c, D = self.c, self.D
        allreduce = 2 * (D - 1) / D * c.model_bytes / (c.coll_gbps * 1e9) if D > 1 else 0.0
        return c.update_call_s + c.update_row_s * rows * c.work_scale / D + allreduce

    def transfer_s(self) -> float:
        return self.c.model_bytes / (self.c.sync_gbps * 1e9)

    # -- feeder: issue step t once version >= t - lag
    def try_issue(self) -> None:
        cfg = self.cfg
        while self.next_issue < cfg.steps and self.actor_version >= self.next_issue - cfg.lag:
            t = self.next_issue
            self.next_issue += 1
            self.steps[t] = _Step(self.rows_per_step)
            end = self.put("rollout", self.now)  # the prompts go into the queue

            def issued(t=t) -> None:
                self.steps[t].issued = True
                self.dispatch_all()
            self.at(end, issued)

    # -- rollout instances pull work
    def dispatch_all(self) -> None:
        for k in range(self.K):
            if not self.inst_busy[k]:
                self.dispatch(k)

    def dispatch(self, k: int) -> None:
        if self.inst_busy[k]:
            return
        lag = self.cfg.lag
        for t in sorted(self.steps):
            s = self.steps[t]
            if not s.issued or s.unassigned == 0:
                continue
            if self.inst_version[k] < t - lag:
                return  # later steps need at least as much
            n = min(self.call_rows, s.unassigned)
            s.unassigned -= n
            self.inst_busy[k] = True
            self.calls += 1
            self._rollout(k, t, n)
            return

    def _rollout(self, k: int, t: int, n: int) -> None:
        t1 = self.rpc(self.get_meta("rollout", n, self.now))
        swap = self.c.swap_s if self.inst_version[k] > self.inst_held[k] else 0.0
        self.inst_held[k] = self.inst_version[k]
        dur = swap + self.rollout_s(n)
        t2 = t1 + dur
        self.inst_spans[k] += dur

        def generated() -> None:
            end = self.put("reward", self.now)  # responses written
            self.at(end, lambda: self._after_rollout(k, t, n))
        self.at(t2, generated)

    def _after_rollout(self, k: int, t: int, n: int) -> None:
        self.inst_busy[k] = False
        # reward on the instance's own lane, overlapping its next generation
        t1 = self.rpc(self.get_meta("reward", n, self.now))
        start = max(t1, self.reward_free[k])
        self.reward_free[k] = start + self.reward_s(n)

        def rewarded() -> None:
            end = self.put("update", self.now)

            def done() -> None:
                self.steps[t].done += n
                self.try_update()
            self.at(end, done)
        self.at(self.reward_free[k], rewarded)
        self.dispatch(k)

    # -- the update: whole step, in order
    def try_update(self) -> None:
        t = self.next_update
        s = self.steps.get(t)
        if self.updating or s is None or s.done < s.rows:
            return
        self.updating = True
        rows = s.rows * self.c.accept
        t1 = self.rpc(self.get_meta("update", int(rows), self.now))
        start = max(t1, self.actor_free)
        dur = self.update_s(rows)
        self.actor_free = start + dur
        self.actor_spans.append((start, self.actor_free))

        def updated() -> None:
            self.updating = False
            self.trained[t] = rows
            self.step_end[t] = self.now
            self.actor_version = t + 1
            self.next_update = t + 1
            del self.steps[t]
            self.publish(t + 1)
            self.try_issue()
            self.try_update()
        self.at(self.actor_free, updated)

    # -- weight sync: publish on the actor, then each instance in turn over the links
    def publish(self, v: int) -> None:
        t1 = self.rpc(self.now)
        start = max(t1, self.actor_free)
        self.actor_free = start + self.c.publish_s
        self.actor_spans.append((start, self.actor_free))

        def published() -> None:
            self.published = v
            self.pump_sync()
        self.at(self.actor_free, published)

    def pump_sync(self) -> None:
        """Start transfers on free links, instances in turn; the newest version only."""
        for li in range(self.links):
            if self.link_free[li] > self.now:
                continue
            k = self._next_behind()
            if k is None:
                return
            v = self.published
            self.sending.add(k)
            t0 = self.rpc(self.now)
            end = t0 + self.transfer_s()
            self.link_free[li] = end
            self.sync_times.append(end - self.now)

            def received(k=k, v=v) -> None:
                self.sending.discard(k)
                self.inst_version[k] = max(self.inst_version[k], v)
                self.dispatch(k)
                self.pump_sync()
            self.at(end, received)

    def _next_behind(self) -> int | None:
        for i in range(self.K):
            k = (self.sync_rr + i) % self.K
            if k not in self.sending and self.inst_version[k] < self.published:
                self.sync_rr = (k + 1) % self.K
                return k
        return None


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration to the end; deterministic for a given ``cfg.seed``."""
    if cfg.mode not in ("sync", "async"):
        raise ValueError(f"mode: expected sync or async, got {cfg.mode!r}")
    if cfg.steps <= cfg.warm:
        raise ValueError("steps must exceed warm")
    r = _Run(cfg)
    r.run()
    ends = [r.step_end[t] for t in range(cfg.steps)]
    rows = [r.trained[t] for t in range(cfg.steps)]
    a = ends[cfg.warm - 1] if cfg.warm > 0 else 0.0
    b = ends[-1]
    window = max(b - a, 1e-12)
    thr = sum(rows[cfg.warm:]) / window
    servers = {id(s): s for s in [r.driver, *r.ctrl.values()]}.values()
    busiest = max(s.busy_in(a, b) for s in servers) / window
    n_req = sum(s.n for s in servers)
    wait = sum(s.wait for s in servers) / max(n_req, 1)
    return SimResult(
        throughput=thr, step_end=ends, rows_trained=rows, makespan=b,
        ctrl_busy_share=busiest, driver_busy_share=r.driver.busy_in(a, b) / window, ctrl_wait_ms=wait * 1e3,
        rollout_util=sum(r.inst_spans) / (r.K * b), train_util=_busy_in(r.actor_spans, 0.0, b) / b,
        sync_s_per_version=(statistics.mean(r.sync_times) if r.sync_times else 0.0),
        instances=r.K, train_devices=r.D, calls=r.calls)


def scale_config(base: SimConfig, k: int, weak: bool) -> SimConfig:
    """The base configuration on k times the devices; weak scaling grows the global batch too."""
    return replace(base, devices=base.devices * k,
                   prompts_per_step=base.prompts_per_step * (k if weak else 1))


def sweep(base: SimConfig, sizes=SIZES, modes=("sync", "async"), weak: bool = True) -> dict[str, list[dict]]:
    """Throughput and efficiency (thr(kN) / (k thr(N))) per size, per mode."""
    out: dict[str, list[dict]] = {}
    for mode in modes:
        rows, first = [], None
        for k in sizes:
            cfg = scale_config(replace(base, mode=mode), k, weak)
            res = simulate(cfg)
            first = first or (k, res.throughput)
            eff = res.throughput / (k / first[0] * first[1])
            rows.append({"k": k, "devices": cfg.devices, "instances": res.instances, "train_devices": res.train_devices,
                         "prompts_per_step": cfg.prompts_per_step, "throughput": res.throughput, "efficiency": eff,
                         "ctrl_busy_share": res.ctrl_busy_share, "driver_busy_share": res.driver_busy_share,
                         "ctrl_wait_ms": res.ctrl_wait_ms, "rollout_util": res.rollout_util,
                         "train_util": res.train_util, "step_s": (res.step_end[-1] - res.step_end[base.warm - 1])
                         / (base.steps - base.warm)})
        out[mode] = rows
    return out


# ---- measured costs ---------------------------------------------------------------------------

def _fit(points: list[tuple[float, float]], pick: Callable[[list[float]], float] = statistics.median
         ) -> tuple[float, float]:
    """dur = a + b * rows by least squares, a >= 0. When rows do not vary (or the fit is noise):
    a = 0 and b = pick(dur / rows) (median by default; min for calls that mostly wait)."""
    if not points:
        raise ValueError("no spans to fit")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    per_row = (0.0, pick([y / max(x, 1e-9) for x, y in points]))
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if len(set(xs)) < 2 or var <= 1e-9 * max(mx * mx, 1.0):
        return per_row
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    a = my - b * mx
    if a < 0 or b <= 0:  # noise: fall back to a pure per-row cost
        return per_row
    return a, b


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def measure_costs(run_dir: str | Path, base: Costs | None = None) -> tuple[Costs, dict]:
    """Per-stage costs from a finished run's files; returns the costs and what was read."""
    run = Path(run_dir)
    base = base or Costs()
    cfg = json.loads((run / "config.json").read_text())
    spans = _jsonl(run / "timeline.jsonl")
    n_actor = len(cfg["placement"]["actor_ranks"]) if cfg["placement"]["mode"] == "disaggregated" \
        else cfg["trainer"]["nproc"]

    def pts(stage: str, lane: str) -> list[tuple[float, float]]:
        seen, out = set(), []
        for s in spans:  # one span per rank: keep one per call
            if s["stage"] == stage and lane in s["lane"] and s.get("rows"):
                key = (s["stage"], round(s["start"], 6), s.get("step"))
                if key not in seen:
                    seen.add(key)
                    out.append((float(s["rows"]), s["end"] - s["start"]))
        return out

    roll, rew, upd = pts("rollout", "rollout"), pts("reward", "reward"), pts("update", "actor")
    if not roll or not upd:
        raise ValueError(f"{run}: timeline.jsonl has no rollout/update spans (did RL run?)")
    lens = []
    if (run / "samples.jsonl").exists():
        lens = [len(r["response_ids"]) for r in _jsonl(run / "samples.jsonl")]
    max_new = cfg["rollout"]["max_new_tokens"]
    len_mean = statistics.mean(lens) if lens else float(max_new)
    len_max = max(lens) if lens else float(max_new)
    ra, rb = _fit(roll)
    wa, wb = _fit(rew, min) if rew else (0.0, 0.0)  # queued behind the update on its rank: the fastest
    ua, ub = _fit(upd)
    pub = [s["end"] - s["start"] for s in spans if s["stage"] == "weight_sync" and "actor" in s["lane"]]
    rec = [s["end"] - s["start"] for s in spans if s["stage"] == "weight_sync" and "rollout" in s["lane"]]
    model_bytes = base.model_bytes
    st = run / "hf_model" / "model.safetensors"
    if st.exists():
        model_bytes = float(st.stat().st_size)
    # a receive waits behind the instance's running generate call: the fastest one is the transfer
    transfer = min(rec) if rec else model_bytes / (base.sync_gbps * 1e9)
    rows_gen = sum(p[0] for p in roll)
    rows_trained = sum(p[0] for p in upd)
    costs = replace(
        base, rollout_call_s=ra, rollout_tok_s=rb / len_max, reward_call_s=wa, reward_row_s=wb,
        update_call_s=ua, update_row_s=ub * n_actor, publish_s=statistics.median(pub) if pub else base.publish_s,
        model_bytes=model_bytes, sync_gbps=model_bytes / max(transfer, 1e-9) / 1e9, len_mean=len_mean,
        accept=min(1.0, rows_trained / max(rows_gen, 1.0)), source=str(run))
    info = {"run": str(run), "rollout_calls": len(roll), "update_calls": len(upd), "reward_calls": len(rew),
            "rollout_rows_per_call": statistics.mean(p[0] for p in roll),
            "rollout_s_per_call": statistics.mean(p[1] for p in roll),
            "update_s_per_call": statistics.mean(p[1] for p in upd), "len_mean": len_mean, "len_max": len_max,
            "weight_receive_s": transfer, "publish_s": costs.publish_s, "model_mb": model_bytes / 1e6,
            "measured_instances": len(cfg["placement"]["rollout_ranks"]), "measured_actor_ranks": n_actor,
            "prompts_per_step": cfg["trainer"]["prompts_per_step"], "group_size": cfg["rollout"]["n"],
            "batch_prompts": cfg["rollout"]["batch_prompts"], "mode": cfg["workflow"]["mode"]}
    return costs, info


def measurement_run(out_dir: Path, steps: int) -> Path:
    """A short async run (no warm-up, no dynamic sampling: every row trains) to measure costs."""
    import shutil
    if out_dir.exists():
        shutil.rmtree(out_dir)
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", "grpo", "workflow.mode=async",
           f"trainer.steps={steps}", "trainer.time_budget_s=0", "trainer.eval_every=0", "trainer.progress=false",
           "warmup.enabled=false", "algorithm.dynamic_sampling=false", "data.num_eval=16",
           f"trainer.out_dir={out_dir}"]
    print("measurement run:", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise SystemExit(f"measurement run failed ({p.returncode}):\n{p.stdout[-3000:]}")
    print(f"measurement run done in {time.time() - t0:.0f} s", flush=True)
    return out_dir


# ---- report -----------------------------------------------------------------------------------

def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for scaling, res in results.items():
        ls = "-" if scaling == "weak" else "--"
        for mode, rows in res.items():
            dev = [r["devices"] for r in rows]
            ax[0].plot(dev, [r["throughput"] for r in rows], ls, marker="o", label=f"{mode} ({scaling})")
            ax[1].plot(dev, [r["efficiency"] for r in rows], ls, marker="o", label=f"{mode} ({scaling})")
            ax[2].plot(dev, [r["ctrl_busy_share"] for r in rows], ls, marker="o", label=f"{mode} ({scaling})")
    ax[1].axhspan(0.65, 0.88, color="green", alpha=0.1, label="paper: 0.65-0.88")
    for a, title in zip(ax, ("rows trained / s", "scaling efficiency thr(kN) / (k thr(N))",
                             "control plane busy share (busiest server)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("devices")
        a.set_title(title, fontsize=10)
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    top = max(r["efficiency"] for res in results.values() for rows in res.values() for r in rows)
    ax[1].set_ylim(0, max(1.05, top + 0.05))
    ax[2].set_ylim(0, 1.05)
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(title: str, res: dict[str, list[dict]]) -> None:
    print(f"\n{title}")
    print(f"{'mode':6} {'x':>3} {'devices':>7} {'inst':>5} {'train':>5} {'prompts':>7} {'rows/s':>10} "
          f"{'eff':>5} {'step s':>7} {'ctrl busy':>9} {'wait ms':>8} {'roll util':>9} {'train util':>10}")
    for mode, rows in res.items():
        for r in rows:
            print(f"{mode:6} {r['k']:>3} {r['devices']:>7} {r['instances']:>5} {r['train_devices']:>5} "
                  f"{r['prompts_per_step']:>7} {r['throughput']:>10.1f} {r['efficiency']:>5.2f} {r['step_s']:>7.2f} "
                  f"{r['ctrl_busy_share']:>9.3f} {r['ctrl_wait_ms']:>8.2f} {r['rollout_util']:>9.2f} "
                  f"{r['train_util']:>10.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", help="a finished run's out_dir to read the measured costs from")
    ap.add_argument("--measure-steps", type=int, default=10, help="steps of the measurement run (no --from-run)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "simulate_scale"))
    ap.add_argument("--quick", action="store_true", help="fewer simulated steps")
    ap.add_argument("--base-devices", type=int, default=48, help="N: the 1x cluster (default 48 -> 768 at 16x)")
    ap.add_argument("--rollout-share", type=float, default=2 / 3, help="rollout devices / all (2:1 -> 0.667)")
    ap.add_argument("--devices-per-instance", type=int, default=1)
    ap.add_argument("--prompts-per-instance", type=int, default=0,
                    help="prompts per step per rollout instance at 1x (0: the measured run's, per instance)")
    ap.add_argument("--batch-prompts", type=int, default=0, help="async prompts per call (0: the measured run's)")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="simulated steps (0: 12, --quick 8)")
    ap.add_argument("--sync-links", type=int, default=0, help="parallel weight-sync links (0: one per train device)")
    ap.add_argument("--controllers", choices=["single", "per_task"], default="single")
    ap.add_argument("--ctrl-ms", type=float, default=1.0, help="controller cost per get_meta (16 rows)")
    ap.add_argument("--ctrl-put-ms", type=float, default=0.3, help="controller cost per put notification")
    ap.add_argument("--ctrl-client-ms", type=float, default=0.0, help="extra cost per connected client per call")
    ap.add_argument("--rpc-ms", type=float, default=0.42, help="driver dispatch per worker call")
    ap.add_argument("--len-sigma", type=float, default=0.9, help="lognormal sigma of response lengths")
    ap.add_argument("--len-cap", type=float, default=5.0, help="response length cap, times the mean")
    ap.add_argument("--work-scale", type=float, default=1.0, help="multiply rollout/update compute (what-if)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()

    base_costs = Costs(ctrl_get_s=args.ctrl_ms * 1e-3, ctrl_put_s=args.ctrl_put_ms * 1e-3,
                       ctrl_client_s=args.ctrl_client_ms * 1e-3, rpc_s=args.rpc_ms * 1e-3,
                       len_sigma=args.len_sigma, len_cap=args.len_cap, work_scale=args.work_scale)
    out = Path(args.out)
    run_dir = Path(args.from_run) if args.from_run else measurement_run(out / "measure_run", args.measure_steps)
    costs, info = measure_costs(run_dir, base_costs)
    print("measured on this machine (" + info["run"] + "):")
    print(f"  rollout: {info['rollout_calls']} calls of {info['rollout_rows_per_call']:.0f} rows, "
          f"{info['rollout_s_per_call']:.3f} s each -> {costs.rollout_call_s * 1e3:.1f} ms/call + "
          f"{costs.rollout_tok_s * 1e6:.1f} us per padded token (longest response {info['len_max']}, "
          f"mean {info['len_mean']:.2f})")
    print(f"  reward: {costs.reward_call_s * 1e3:.1f} ms/call + {costs.reward_row_s * 1e6:.1f} us/row; "
          f"update: {costs.update_call_s * 1e3:.1f} ms/call + {costs.update_row_s * 1e3:.2f} ms/row on one device")
    print(f"  weight sync: publish {costs.publish_s * 1e3:.1f} ms, receive {info['weight_receive_s'] * 1e3:.1f} ms "
          f"for {info['model_mb']:.2f} MB ({costs.sync_gbps:.3f} GB/s); rows trained / generated "
          f"{costs.accept:.2f}")
    print(f"modelled: lengths lognormal sigma {costs.len_sigma}, cap {costs.len_cap} x mean; controller "
          f"{costs.ctrl_get_s * 1e3:.2f} ms/get_meta + {costs.ctrl_put_s * 1e3:.2f} ms/put, rpc "
          f"{costs.rpc_s * 1e3:.2f} ms/call, +{costs.ctrl_client_s * 1e3:.2f} ms/client")

    per_inst = args.prompts_per_instance or max(1, info["prompts_per_step"] // max(info["measured_instances"], 1))
    steps = args.steps or (8 if args.quick else 12)
    base = SimConfig(devices=args.base_devices, rollout_share=args.rollout_share,
                     devices_per_instance=args.devices_per_instance, max_staleness=args.max_staleness,
                     group_size=info["group_size"], batch_prompts=args.batch_prompts or info["batch_prompts"],
                     steps=steps, warm=2, sync_links=args.sync_links, controllers=args.controllers,
                     seed=args.seed, costs=costs)
    base = replace(base, prompts_per_step=per_inst * base.instances)
    print(f"1x cluster: {base.devices} devices = {base.instances} rollout instances x "
          f"{base.devices_per_instance} + {base.train_devices} training; {base.prompts_per_step} prompts x "
          f"{base.group_size} per step; {steps} steps simulated, throughput over the last {steps - 2}")

    results = {"weak": sweep(base, weak=True), "strong": sweep(base, weak=False)}
    _table("weak scaling (global batch grows with the cluster)", results["weak"])
    _table("strong scaling (global batch fixed)", results["strong"])

    # what-ifs at 16x (weak, async): where the control plane would become the critical path
    big = replace(scale_config(base, 16, True), mode="async")
    whatif = {
        "default": simulate(big),
        "one_sync_link (code today)": simulate(replace(big, sync_links=1)),
        "ctrl x10": simulate(replace(big, costs=replace(costs, ctrl_get_s=costs.ctrl_get_s * 10,
                                                        ctrl_put_s=costs.ctrl_put_s * 10))),
        "ctrl +0.36 ms/client": simulate(replace(big, costs=replace(costs, ctrl_client_s=0.36e-3))),
        "ctrl +0.36 ms/client, per_task": simulate(replace(big, controllers="per_task", costs=replace(
            costs, ctrl_client_s=0.36e-3))),
    }
    ref = results["weak"]["async"][0]["throughput"] * 16
    print("\nwhat-if at 16x (weak, async): efficiency, busiest control-plane server's busy share")
    for name, r in whatif.items():
        print(f"  {name:34} eff {r.throughput / ref:5.2f}  ctrl busy {r.ctrl_busy_share:5.3f}  "
              f"wait {r.ctrl_wait_ms:8.2f} ms  rollout util {r.rollout_util:4.2f}")

    png = out / "scale.png"
    plot(results, png)
    print(f"\nplot: {png}")
    w, s = results["weak"], results["strong"]
    summary = {
        "efficiency_weak": {m: {str(r["k"]): round(r["efficiency"], 3) for r in rows} for m, rows in w.items()},
        "efficiency_strong": {m: {str(r["k"]): round(r["efficiency"], 3) for r in rows} for m, rows in s.items()},
        "async_over_sync_16x_weak": round(w["async"][-1]["throughput"] / w["sync"][-1]["throughput"], 3),
        "ctrl_busy_share_16x": {"sync_weak": round(w["sync"][-1]["ctrl_busy_share"], 4),
                                "async_weak": round(w["async"][-1]["ctrl_busy_share"], 4),
                                "async_strong": round(s["async"][-1]["ctrl_busy_share"], 4)},
        "controller_on_critical_path_16x": w["async"][-1]["ctrl_busy_share"] > 0.8,
        "whatif_16x_async": {k: {"efficiency": round(v.throughput / ref, 3), "ctrl_busy_share":
                                 round(v.ctrl_busy_share, 4)} for k, v in whatif.items()},
        "base_devices": base.devices, "costs_from": costs.source, "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
