"""One simulated cluster run: the real driver, executor and TransferQueue drive simulated ranks.

What runs for real: the driver (``single_controller.Driver``: calls, heartbeats, dispatch),
the workflow ``Executor`` with the simulation recipe's stages, the prompt source, the
TransferQueue controller (in this process, on its own event-loop thread, as in a run) and
its storage units (one per host process of simulated ranks: a node's unit), the worker
runtimes of every rank, the rollout service and row stream, every RPC and every put/get.
What is simulated: the device work inside each worker call (``workers.py``, priced by
``costs.py``, slowed to wall time by ``clock.py``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..single_controller import Driver, DriverConfig, Group, GroupSpec
from ..transfer_queue import AsyncTransferQueueClient, TransferQueueConfig, TransferQueueService
from ..workflow.executor import Executor, ExecutorConfig, StepObserver, StepReport
from ..workflow.source import PromptSource, longtail_budgets, row_seed
from ..workflow.staleness import allowed_lag
from . import probes
from .costs import MODELS
from .driver_data import DriverDataGroup, columns_before
from .hosts import SimHosts
from .recipe import SOURCE_COLUMNS, RecipeSizes, build
from .spec import SimSpec

log = logging.getLogger(__name__)
MODES = ("sync", "stream", "async")
DATA_PATHS = ("tq", "driver")
DRIVER_CARRIES = ("inputs", "all")
_T = TypeVar("_T")


def _started(part: _T | None, what: str) -> _T:
    """``part`` of the run, which the run must have set by now."""
    if part is None:
        raise RuntimeError(f"simulated cluster run: {what} is not set (the run did not get that far)")
    return part


@dataclass
class ClusterConfig:
    devices: int = 16
    mode: str = "async"  # sync (colocated, verl-style) | stream | async (disaggregated)
    data_path: str = "tq"  # tq | driver (the centralized baseline)
    driver_carries: str = "inputs"  # driver path: each call's inputs | every column the rows have (DataProto)
    model: str = "qwen2.5-7b"
    scale: float = 0.5  # wall seconds per simulated second of device work
    prompts_per_step: int = 4
    group_size: int = 8
    # The throughput window: ``warm_steps`` first, then ``measured_steps``, then ``tail_steps``
    # that keep the pipeline as full when the window closes as it was when it opened (async
    # generates up to ``max_staleness`` steps ahead; without a tail its last steps would have
    # nothing to generate, and the rows generated before the window opened would count in it).
    warm_steps: int = 2
    measured_steps: int = 3
    tail_steps: int | None = None  # None: max_staleness in async mode, 0 otherwise
    rollout_share: float = 0.5  # disaggregated: the devices that generate
    max_staleness: int = 1
    prompt_tokens: tuple[int, int] = (128, 512)  # uniform per prompt
    max_response_tokens: int = 2048  # long-tailed lengths below it (workflow.source.longtail_budgets)
    response_median_frac: float = 0.4  # median 819 tokens, mean ~930, 1% reach the cap
    response_sigma: float = 0.5
    max_running_rows: int = 32  # per rollout instance
    rows_per_device_call: int = 4  # rows per training rank per map call (stream / async)
    rollout_call_groups: int = 1  # groups per rollout submit
    ranks_per_reward: int = 8  # one CPU reward worker per this many rollout ranks (a node's)
    hosts: int = 2  # processes hosting the simulated ranks (each with a storage unit)
    fan_out_interval_s: float = 1.0  # how often the fan-out probe calls every training rank
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {DATA_PATHS}, got {self.data_path!r}")
        if self.driver_carries not in DRIVER_CARRIES:
            raise ValueError(f"driver_carries must be one of {DRIVER_CARRIES}, got {self.driver_carries!r}")
        if self.data_path == "driver" and self.mode != "sync":
            raise ValueError("the centralized (driver) data path is the verl-style baseline: mode sync only")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        if self.warm_steps < 1 or self.measured_steps < 1 or (self.tail_steps or 0) < 0:
            raise ValueError(f"the window needs warm_steps >= 1 and measured_steps >= 1 (and tail_steps >= 0), "
                             f"got {self.warm_steps}, {self.measured_steps}, {self.tail_steps}")

    @property
    def tail(self) -> int:
        if self.tail_steps is not None:
            return self.tail_steps
        return allowed_lag(self.mode, self.max_staleness)

    @property
    def steps(self) -> int:
        """Steps run in all: warm-up, window, tail."""
        return self.warm_steps + self.measured_steps + self.tail

    def in_window(self, step: int) -> bool:
        return self.warm_steps <= step < self.warm_steps + self.measured_steps

    @property
    def colocated(self) -> bool:
        return self.mode == "sync"

    @property
    def tp(self) -> int:
        return MODELS[self.model].rollout_tp


@dataclass
class Layout:
    world: int
    actor: list[int]
    instances: list[list[int]]
    reward: list[int]
    train_devices: int
    rollout_devices: int

    @staticmethod
    def of(cfg: ClusterConfig) -> Layout:
        tp = cfg.tp
        if cfg.colocated:  # every device trains; an instance of tp devices generates on them in turn
            ranks = list(range(cfg.devices))
            inst = [[r] for r in ranks[::tp]]
            return Layout(cfg.devices, ranks, inst, [i[0] for i in inst][::cfg.ranks_per_reward], cfg.devices,
                          cfg.devices)
        n_inst = max(1, round(cfg.devices * cfg.rollout_share / tp))
        train = cfg.devices - n_inst * tp
        if train < 1:
            raise ValueError(f"{cfg.devices} devices leave no training device beside {n_inst} instances of {tp}")
        # an instance is one rank standing for its tp devices (the trainer builds one rank per instance)
        rollout = list(range(train, train + n_inst))
        return Layout(train + n_inst, list(range(train)), [[r] for r in rollout], rollout[::cfg.ranks_per_reward],
                      train, n_inst * tp)


class _Records:
    """An endless stream of prompts of random lengths (the token ids do not matter)."""

    def __init__(self, lo: int, hi: int, seed: int):
        self.rng = random.Random(seed)
        self.lo, self.hi = lo, hi

    def __iter__(self) -> _Records:
        return self

    def __next__(self) -> dict:
        n = self.rng.randint(self.lo, self.hi)
        return {"prompt_ids": list(range(1, n + 1)), "answer": "0"}


@dataclass
class _Window:
    """The measured part of a run: from the end of the warm-up steps to the end of the last measured
    step (the tail steps run after it, so the window closes on a pipeline in its steady state)."""
    wall: float = 0.0
    controller_cpu: float = 0.0
    driver_cpu: float = 0.0
    hosts_cpu: float = 0.0
    units_cpu: float = 0.0
    machine: tuple[float, float] = (0.0, 0.0)
    put_bytes: float = 0.0
    get_metas: int = 0


class _Recorder(StepObserver):
    def __init__(self, run: _Run):
        self.run = run
        self.reports: list[StepReport] = []
        self.trained_rows: dict[int, int] = {}

    async def step_done(self, report: StepReport) -> None:
        self.reports.append(report)
        cfg = self.run.cfg
        if report.step == cfg.warm_steps - 1:
            self.run.begin = await self.run.mark()
            self.run.measuring(True)
        if report.step == cfg.warm_steps + cfg.measured_steps - 1:
            self.run.end = await self.run.mark()
            self.run.measuring(False)


@dataclass
class _Run:
    cfg: ClusterConfig
    tq: Any = None
    hosts: SimHosts | None = None
    fan_out: probes.FanOutProbe | None = None
    get_meta: probes.GetMetaProbe | None = None
    begin: _Window | None = None
    end: _Window | None = None
    get_meta_lat: list[float] = field(default_factory=list)

    async def mark(self) -> _Window:
        stats = await self.tq.unit_stats()
        status = await self.tq.status()
        hosts = _started(self.hosts, "the hosts")
        return _Window(time.monotonic(), probes.thread_cpu_s("tq-service"), time.thread_time(),
                       sum(probes.process_cpu_s(p) for p in hosts.pids),
                       sum(probes.process_cpu_s(p) for p in hosts.unit_pids), probes.machine_busy(),
                       float(sum(sum(s["put_bytes_by_node"].values()) for s in stats)),
                       int(status["stats"]["get_meta"]))

    def measuring(self, on: bool) -> None:
        _started(self.fan_out, "the fan-out probe").recording = on
        get_meta = _started(self.get_meta, "the get_meta probe")
        if on:
            get_meta.start()
        else:
            self.get_meta_lat = get_meta.stop()


def simulate(cfg: ClusterConfig) -> dict:
    """Run ``cfg`` and return its measurements (one dict, JSON-ready)."""
    lay = Layout.of(cfg)
    central = cfg.data_path == "driver"
    # The controller on its own thread (as in a run); with the TransferQueue, the bytes live in the
    # hosts' units (a node each); the centralized baseline keeps them in the driver's process.
    service = TransferQueueService(TransferQueueConfig(num_local_units=1 if central else 0,
                                                       wait_timeout_s=cfg.timeout_s)).start_in_thread()
    run = _Run(cfg)
    try:
        run.hosts = hosts = SimHosts(lay.world, cfg.hosts, service.controller_address, with_units=not central)
        try:
            run.get_meta = get_meta = probes.GetMetaProbe(service.controller_address)
            try:
                return asyncio.run(_drive(cfg, lay, run, service.controller_address))
            finally:
                get_meta.close()
        finally:
            hosts.close()
    finally:
        service.stop_in_thread()


async def _drive(cfg: ClusterConfig, lay: Layout, run: _Run, controller: str) -> dict:
    spec = SimSpec(cfg.model, cfg.scale, lay.train_devices, len(lay.instances), cfg.seed, cfg.max_running_rows,
                   cfg.colocated, cfg.data_path == "driver").to_dict()
    g = cfg.group_size
    map_rows = max(g, -(-cfg.rows_per_device_call * lay.train_devices // g) * g)
    recipe = build(RecipeSizes(g, cfg.rollout_call_groups * g, map_rows))
    run.tq = tq = AsyncTransferQueueClient(controller, wait_timeout=cfg.timeout_s)
    # Heartbeats as in a run, but a rank is declared dead only after 30 s of silence: the hosts of
    # simulated ranks share this machine's cores with whatever else runs on it.
    hosts = _started(run.hosts, "the hosts")
    driver = Driver(hosts.addresses, config=DriverConfig(call_timeout_s=cfg.timeout_s, heartbeat_timeout_s=10.0,
                                                         heartbeat_misses=3),
                    transfer_queue_address=controller)
    started = time.monotonic()
    await driver.start()
    try:
        return await driver.run(_workflow(cfg, lay, run, driver, recipe, spec, started))
    finally:
        await tq.close()
        await driver.shutdown()


async def _workflow(cfg: ClusterConfig, lay: Layout, run: _Run, driver: Driver, recipe: Any, spec: dict,
                    started: float) -> dict:
    roles = recipe.roles
    made = await driver.create_groups(
        [GroupSpec(roles["actor"].worker_class(), "actor", lay.actor, None, {"sim": spec}),
         GroupSpec(roles["ref"].worker_class(), "ref", lay.actor, None, {"sim": spec}),
         GroupSpec(roles["reward"].worker_class(), "reward", lay.reward, None, {"sim": spec})]
        + [GroupSpec(roles["rollout"].worker_class(), f"rollout{k}", r, None, {"sim": spec})
           for k, r in enumerate(lay.instances)])
    groups: dict[str, Group] = dict(zip(("actor", "ref", "reward"), made[:3]))
    instances: list[Group] = list(made[3:])
    actor = groups["actor"]
    await asyncio.gather(actor.init_weight_sync([i.ranks for i in instances]),
                         *(i.init_weight_sync(actor.ranks[0]) for i in instances))
    start_s = time.monotonic() - started
    if cfg.data_path == "driver":
        carried = columns_before(recipe.stages, SOURCE_COLUMNS) if cfg.driver_carries == "all" else None
        groups = {k: DriverDataGroup(v, run.tq, carried) for k, v in groups.items()}
        instances = [DriverDataGroup(i, run.tq, carried) for i in instances]
    source = PromptSource(_Records(*cfg.prompt_tokens, cfg.seed), g := cfg.group_size, cfg.seed,
                          budget_fn=longtail_budgets(cfg.seed, cfg.max_response_tokens, cfg.response_median_frac,
                                                     cfg.response_sigma))
    ecfg = ExecutorConfig(mode=cfg.mode, max_staleness=cfg.max_staleness, group_size=g,
                          prompts_per_step=cfg.prompts_per_step, dynamic_sampling=False, max_refill_factor=1.0,
                          wait_timeout_s=cfg.timeout_s, rollout_service=not cfg.colocated)
    recorder = _Recorder(run)
    executor = Executor(ecfg, recipe.stages, groups, instances, run.tq, source, observers=[recorder],
                        policy="actor")
    run.fan_out = fan_out = probes.FanOutProbe(actor, cfg.fan_out_interval_s)
    fan_out.start()
    t0 = time.monotonic()
    try:
        await executor.run(cfg.steps)
    finally:
        await fan_out.stop()
    wall = time.monotonic() - t0
    audit = await _audit(cfg, source, actor, groups, instances, run.tq)
    return _result(cfg, lay, run, recorder, wall, start_s, audit)


async def _audit(cfg: ClusterConfig, source: PromptSource, actor: Any, groups: dict, instances: list,
                 tq: Any) -> dict:
    """Did every issued row reach every stage once, and train once?"""
    issued = [row_seed(cfg.seed, uid, j) for uid in range(source.next_uid) for j in range(cfg.group_size)]
    trained = [int(s) for a in await actor.audit() for s in a["seeds"].tolist()]

    async def rows(group: Any, kind: str) -> int:
        return sum(a["rows"].get(kind, 0) for a in await group.audit())
    generated = sum([await rows(i, "generate") for i in instances])
    status = await tq.status()
    left = [p for p in status["partitions"] if p != "probe"]
    return {"issued": len(issued), "trained": len(trained), "trained_distinct": len(set(trained)),
            "trained_equals_issued": sorted(trained) == sorted(issued) and len(set(issued)) == len(issued),
            "generated": generated, "scored": await rows(groups["reward"], "score"),
            "old_log_probs": await rows(groups["actor"], "log_probs"),
            "ref_log_probs": await rows(groups["ref"], "log_probs"), "partitions_left": left}


def _result(cfg: ClusterConfig, lay: Layout, run: _Run, rec: _Recorder, wall: float, start_s: float,
            audit: dict) -> dict:
    b, e = _started(run.begin, "the window's start"), _started(run.end, "the window's end")
    span = e.wall - b.wall
    sim_s = span / cfg.scale
    measured = [r for r in rec.reports if cfg.in_window(r.step)]
    rows = sum(r.rows for r in measured)
    steps = cfg.measured_steps
    tokens_per_row = _mean_tokens(cfg)
    busy, total = e.machine[0] - b.machine[0], e.machine[1] - b.machine[1]
    return {
        "config": {**asdict(cfg), "prompt_tokens": list(cfg.prompt_tokens)},
        "devices": cfg.devices, "ranks": lay.world, "train_devices": lay.train_devices,
        "rollout_devices": lay.rollout_devices, "instances": len(lay.instances),
        "samples_per_s": rows / sim_s, "tokens_per_s": rows * tokens_per_row / sim_s,
        "step_s": sim_s / steps, "rows_per_step": rows / steps, "wall_s": wall, "start_s": start_s,
        "controller_busy": (e.controller_cpu - b.controller_cpu) / span,
        "driver_busy": (e.driver_cpu - b.driver_cpu) / span,
        "hosts_cpu_cores": (e.hosts_cpu - b.hosts_cpu) / span,
        "units_cpu_cores": (e.units_cpu - b.units_cpu) / span,  # the hosts' storage units (node-side data plane)
        "machine_busy": busy / total if total else float("nan"),
        "machine_cores": os.cpu_count(),
        "get_meta": probes.summary_us(run.get_meta_lat),
        "fan_out": {"ranks": len(lay.actor), **probes.summary_us(_started(run.fan_out, "the fan-out probe").latencies)},
        # wall seconds the executor booked per stage and step (calls summed over instances): where time goes
        "stage_wall_s_per_step": {k: sum(r.timing.get(k, 0.0) for r in measured) / steps
                                  for k in sorted({k for r in measured for k in r.timing})},
        "tq_put_bytes_per_step": (e.put_bytes - b.put_bytes) / steps,
        "get_meta_calls_per_step": (e.get_metas - b.get_metas - len(run.get_meta_lat)) / steps,  # not the probe's
        "audit": audit,
    }


def _mean_tokens(cfg: ClusterConfig) -> float:
    """Mean prompt + response tokens of a row under the workload's length distributions."""
    budget = longtail_budgets(cfg.seed, cfg.max_response_tokens, cfg.response_median_frac, cfg.response_sigma)
    resp = sum(budget(u, j) for u, j in itertools.product(range(200), range(cfg.group_size))) / (200 * cfg.group_size)
    return sum(cfg.prompt_tokens) / 2 + resp
