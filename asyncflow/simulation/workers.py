"""Simulated workers: the calls a real rollout / actor / reference / reward worker serves,
with the device work replaced by a hold of the cost model's time.

Everything around the hold is the real code: rows come from and go to the TransferQueue
through the worker's own client (``self.tq``), the rollout instance is the real
``RolloutService`` and ``RowStream`` around a simulated engine, the update asks for its
share with the data-parallel representative rule and the token-balanced sampler. The
``*_data`` methods are the centralized baseline (verl's DataProto): the same work, with the
columns in the call's arguments and reply instead of the TransferQueue.

A data-parallel group runs no collectives here (simulated ranks have no process group):
each rank prices its call by the largest share of the batch times the slowest rank's
straggler draw (stragglers.py), as a synchronous all-reduce would make every rank wait for
both, so every rank holds for the same time; an update adds the gradient all-reduce.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .. import column_names as col
from ..engines.rollout import SamplingParams
from ..engines.rollout.base import GenerationRequest
from ..engines.rollout.columns import ROLLOUT_OUTPUTS, result_columns
from ..engines.rollout.service import RolloutService
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.columns import Column, FixedColumn, JaggedColumn, column_from_wire, column_to_wire, to_column
from ..transfer_queue.meta import BatchMeta
from ..workers.rollout_stream import ROLLOUT_INPUTS, RowStream
from ..workflow.stages import StageIO
from ..workflow.update_request import UpdateRequest
from .engine import SimRequestEngine
from .spec import SimSpec
from .stragglers import slowdowns, slowest

PER_TOKEN_DTYPE = torch.float32


def pack(columns: dict[str, Any]) -> dict[str, dict]:
    """Columns (Column objects, tensors or lists of row tensors) as call arguments."""
    return {k: column_to_wire(v if isinstance(v, Column) else to_column(k, v)) for k, v in columns.items()}


def unpack(wire: dict[str, dict]) -> dict[str, Column]:
    return {k: column_from_wire(v) for k, v in wire.items()}


def lengths(column: Column) -> list[int]:
    return column.lengths().tolist() if isinstance(column, JaggedColumn) else [1] * len(column)


def jagged(column: Column, name: str) -> JaggedColumn:
    """Column ``name`` as the row-per-tensor column it must be (token ids)."""
    if not isinstance(column, JaggedColumn):
        raise TypeError(f"column {name!r}: expected a jagged column (a tensor per row), got {type(column).__name__}")
    return column


def fixed(column: Column, name: str) -> torch.Tensor:
    """Column ``name``'s tensor, one value per row (seeds, budgets)."""
    if not isinstance(column, FixedColumn):
        raise TypeError(f"column {name!r}: expected a fixed column (one value per row), got {type(column).__name__}")
    return column.data


def largest_share(meta: BatchMeta, dp_size: int, mine: BatchMeta, my_tokens: int) -> float:
    """The model tokens of the largest data-parallel share, from the controller's per-row token
    counts (every jagged column of the row) scaled to this rank's measured share."""
    counted, start = [], 0
    for size in meta.part_sizes(dp_size):  # sizes only: no BatchMeta per share
        counted.append(sum(meta.tokens[start:start + size]) if meta.tokens else size)
        start += size
    mine_counted = sum(mine.tokens) if mine.tokens else len(mine)
    if not mine_counted:
        return float(my_tokens)
    return max(counted) * my_tokens / mine_counted


class SimWorker(Worker):
    def __init__(self, sim: dict):
        self.spec = SimSpec.of(sim)
        self.clock = self.spec.clock
        self.costs = self.spec.costs
        self.calls = 0
        self.rows: dict[str, int] = {}  # rows computed on, by kind of call (the exactly-once audit)
        self.seeds: list[torch.Tensor] = []  # the seeds of the rows trained (the update's audit)
        self._collectives: dict[str, int] = {}  # calls of each kind so far: the same on every rank of a group

    def _straggle(self, kind: str) -> float:
        """The slowest rank's slowdown for this collective call (every rank of the group draws the same)."""
        n = self._collectives[kind] = self._collectives.get(kind, 0) + 1
        return slowest(self.spec.seed, f"{type(self).__name__}:{kind}:{n}", self.spec.train_devices,
                       self.costs.straggler_sigma)

    def _count(self, kind: str, n: int) -> None:
        self.calls += 1
        self.rows[kind] = self.rows.get(kind, 0) + int(n)

    def _state_bytes(self) -> float:
        return 0.0

    def _get_columns(self, meta: BatchMeta, names: list[str]) -> dict[str, Column]:
        """Rows ``meta`` of columns ``names`` as Columns, from this rank's blocking client."""
        return self.tq.get_columns(meta, names)

    # colocated placement: the role that goes idle moves its state to host memory and back
    def offload(self) -> None:
        if self.spec.colocated:
            self.clock.hold(self.costs.offload_s(self._state_bytes()))

    def onload(self) -> None:
        if self.spec.colocated:
            self.clock.hold(self.costs.offload_s(self._state_bytes()))

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def noop(self) -> int:
        """Nothing: the driver times a round trip to every rank of the group (fan-out latency)."""
        return self.rank

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def audit(self) -> dict:
        """Rows computed on, by kind, and the seeds of the rows trained here."""
        seeds = torch.cat(self.seeds) if self.seeds else torch.zeros(0, dtype=torch.long)
        return {"calls": self.calls, "rows": dict(self.rows), "seeds": seeds}


class _Service(RolloutService):
    """The real rollout service; each command also wakes the simulated engine's sleep."""

    engine: SimRequestEngine

    def _post(self, command: Any) -> None:
        super()._post(command)
        self.engine.nudge()


class SimRolloutWorker(SimWorker):
    """A rollout instance of ``model.rollout_tp`` devices."""

    def __init__(self, sim: dict):
        super().__init__(sim)
        cap = self.spec.max_running_rows
        seed, sigma, me = self.spec.seed, self.costs.straggler_sigma, self.rank
        self.engine = SimRequestEngine(self.costs, self.clock, cap, swap_s=self.costs.offload_s(
            self.costs.model.weight_bytes / self.costs.model.rollout_tp),
            slowdown=lambda version: slowdowns(seed, f"rollout{me}:{version}", 1, sigma)[0])
        # Idle, the service loop sleeps until a command wakes it (every command does): no 20 Hz poll
        # per instance, which with hundreds of instances in two processes would be most of their CPU.
        self.service = _Service(self.engine, name=f"sim-rollout-rank{self.rank}", in_flight=True, idle_wait_s=1.0)
        self.params = SamplingParams(max_new_tokens=1 << 20, temperature=1.0)
        self.stream = RowStream(self.service, lambda: self.tq, self.params, capacity=cap + max(1, cap // 4),
                                version=lambda: int(self.engine.version), name=f"sim-rollout-rank{self.rank}")
        self._arrivals: dict[int, float] = {}  # version -> when its weights have arrived (monotonic)
        self._lock = threading.Lock()
        self._ids = 0

    def _state_bytes(self) -> float:
        return self.costs.model.weight_bytes / self.costs.model.rollout_tp

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, src_rank: int) -> None:
        self.src_rank = src_rank

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def receive_weights(self, version: int) -> None:
        """The bytes take the link's time to arrive; generation goes on meanwhile."""
        with self._lock:
            self._arrivals[int(version)] = time.monotonic() + self.clock.wall(
                self.costs.weight_sync_s(self.spec.instances, self.spec.train_devices))

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def swap_weights(self, version: int) -> dict:
        with self._lock:
            due = self._arrivals.pop(int(version), None)
        if due is None:
            if self.engine.version >= version:
                return {"version": int(self.engine.version), "pause_s": 0.0}
            raise RuntimeError(f"simulated rollout rank {self.rank}: swap_weights({version}) before receive_weights")
        time.sleep(max(0.0, due - time.monotonic()))
        return self.service.update_weights({}, int(version)).result(600.0)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def take_weights(self, version: int) -> dict:
        """receive_weights then swap_weights, in one call (the first swap wave's)."""
        self.receive_weights(version)
        return self.swap_weights(version)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def version(self) -> int:
        return int(self.engine.version)

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def submit(self, meta: Any, min_version: int, want_free: int = 1, wait_s: float = 30.0,
               io: dict | None = None) -> dict:
        if meta is not None:
            self._count("generate", len(meta))
            self.stream.submit(meta, min_version, StageIO.of(io, ROLLOUT_INPUTS, ROLLOUT_OUTPUTS))
        return self.stream.wait_capacity(want_free, wait_s)

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def capacity(self) -> int:
        return self.stream.capacity

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def drain(self, timeout_s: float = 600.0) -> int:
        self.stream.drain(timeout_s)
        return self.stream.rows_written

    def _generate(self, cols: dict[str, Column], min_version: int, io: StageIO) -> dict:
        """One batch through the service (the colocated path: the call holds the rank)."""
        prompt, seed, *rest = io.inputs
        prompt_col = jagged(cols[prompt], prompt)
        prompts = [prompt_col.row(i) for i in range(len(prompt_col))]
        seeds = fixed(cols[seed], seed).tolist()
        budgets = fixed(cols[rest[0]], rest[0]).tolist() if rest else [None] * len(prompts)
        self._count("generate", len(prompts))
        futs = []
        for p, s, b in zip(prompts, seeds, budgets):
            self._ids += 1
            futs.append(self.service.submit(GenerationRequest(f"gen-{self._ids}", p, self.params, int(s), b,
                                                              int(min_version))))
        results = [f.result(600.0) for f in futs]
        return result_columns(results, int(self.engine.version), io.outputs)

    @register(Dispatch.DP_COMPUTE)
    def generate(self, data: Any, min_version: int, io: dict | None = None) -> dict:
        stage = StageIO.of(io, ROLLOUT_INPUTS, ROLLOUT_OUTPUTS)
        return self._generate({c: to_column(c, data[c]) for c in stage.inputs}, min_version, stage)

    @register(Dispatch.RANK_ZERO)
    def generate_data(self, columns: dict, min_version: int, io: dict) -> dict:
        """The centralized baseline: the prompts in the call, the responses in the reply."""
        return pack(self._generate(unpack(columns), min_version, StageIO.of(io)))

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def stats(self) -> dict:
        s = self.service.stats(60.0)
        return {**s, "rows_written": self.stream.rows_written, "calls": self.calls, "rows": dict(self.rows)}


def _per_token_out(cols: dict[str, Column], response: str) -> list[torch.Tensor]:
    """One float per response token (log-probs), of the right lengths."""
    return [torch.zeros(n, dtype=PER_TOKEN_DTYPE) - 1.0 for n in lengths(cols[response])]


class _LogProbs(SimWorker):
    """Log-probs of [prompt, response] under the weights held: a forward pass."""

    def _forward_s(self, tokens: float) -> float:
        return self.costs.forward_s(tokens) * self._straggle("forward")

    def _forward(self, cols: dict[str, Column], prompt: str, response: str, largest: float | None) -> list:
        mine = sum(lengths(cols[prompt])) + sum(lengths(cols[response]))
        self._count("log_probs", len(cols[response]))
        self.clock.hold(self._forward_s(largest if largest is not None else mine))
        return _per_token_out(cols, response)

    @register(Dispatch.ONE_TO_ALL)
    def compute_log_probs(self, meta: Any, io: dict | None = None) -> None:
        stage = StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.OLD_LOG_PROBS])
        prompt, response = stage.inputs[:2]
        mine = meta.part(self.dp_size, self.dp_rank)
        if not len(mine):  # a rank with no rows still waits for the others (the forward is collective)
            self.clock.hold(self._forward_s(largest_share(meta, self.dp_size, mine, 0)))
            return None
        cols = self._get_columns(mine, [prompt, response])
        tokens = sum(lengths(cols[prompt])) + sum(lengths(cols[response]))
        out = self._forward(cols, prompt, response, largest_share(meta, self.dp_size, mine, tokens))
        self.tq.put({stage.outputs[0]: out}, mine.partition, mine)
        return None

    @register(Dispatch.ALL_TO_ALL)
    def compute_log_probs_data(self, columns: dict, largest: float, io: dict) -> dict:
        stage = StageIO.of(io)
        prompt, response = stage.inputs[:2]
        cols = unpack(columns)
        if not cols or not len(cols[response]):
            self.clock.hold(self._forward_s(largest))
            return {}
        return pack({stage.outputs[0]: self._forward(cols, prompt, response, largest)})


class SimReferenceWorker(_LogProbs):
    def _state_bytes(self) -> float:  # bf16 weights, sharded over the group
        return self.costs.model.weight_bytes / max(self.spec.train_devices, 1)


class SimActorWorker(_LogProbs):
    """The policy: trains, recomputes proximal log-probs, publishes its weights."""

    def _state_bytes(self) -> float:  # bf16 weights + fp32 master and Adam moments, sharded
        return 8 * self.costs.model.params / max(self.spec.train_devices, 1)

    def _train_s(self, tokens: float) -> float:
        """The slowest rank's forward and backward, then the gradient all-reduce."""
        return self.costs.train_s(tokens) * self._straggle("train") + self.costs.grad_sync_s(self.spec.train_devices)

    def _train(self, cols: dict[str, Column], largest: float) -> dict:
        n = len(cols[col.RESPONSE_IDS]) if col.RESPONSE_IDS in cols else 0
        self._count("update", n)
        self.clock.hold(self._train_s(largest))
        if col.SEED in cols:
            self.seeds.append(fixed(cols[col.SEED], col.SEED).clone())
        resp = sum(lengths(cols[col.RESPONSE_IDS])) if n else 0
        prompt = sum(lengths(cols[col.PROMPT_IDS])) if n else 0
        return {"rows": n, "response_tokens": resp, "prompt_tokens": prompt}

    @register(Dispatch.ONE_TO_ALL)
    def update(self, step: int, request: dict, io: dict | None = None) -> dict:
        req, stage = UpdateRequest.from_wire(request), StageIO.of(io)
        meta = self.tq.get_meta(stage.inputs, req.rows, req.task, req.partition,
                                {"name": "token_balanced", "dp_size": self.dp_size},
                                timeout=req.timeout_s, dp_group=self.role,
                                dp_rank=self.dp_rank, dp_size=self.dp_size)
        mine = meta.part(self.dp_size, self.dp_rank)
        if not len(mine):
            return {**self._train({}, largest_share(meta, self.dp_size, mine, 0)), "step": step}
        cols = self._get_columns(mine, list(stage.inputs))
        tokens = sum(lengths(cols[col.PROMPT_IDS])) + sum(lengths(cols[col.RESPONSE_IDS]))
        return {**self._train(cols, largest_share(meta, self.dp_size, mine, tokens)), "step": step}

    @register(Dispatch.ALL_TO_ALL)
    def update_data(self, step: int, columns: dict, largest: float, io: dict) -> dict:
        return {**self._train(unpack(columns), largest), "step": step}

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, instances: list) -> None:
        self.instances = len(instances)

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self, version: int) -> dict:
        """Gather the full weights for sending (the sends themselves are the instances' receive time)."""
        self.clock.hold(self.costs.gather_s(self.spec.train_devices))
        return {"bytes": self.costs.model.weight_bytes} if self.group_rank == 0 else {}

    @register(Dispatch.ONE_TO_ALL)
    def wait_weights_sent(self) -> None:
        return None


class SimRewardWorker(SimWorker):
    """A rule-based reward (CPU): a score per row, 0 or 1 from the row's seed."""

    needs_device = False

    def _score(self, cols: dict[str, Column], seed: str) -> torch.Tensor:
        self._count("score", len(cols[seed]))
        self.clock.hold(self.costs.call_overhead_s)
        return (fixed(cols[seed], seed) % 2).float()

    @register(Dispatch.DP_COMPUTE)
    def compute(self, data: Any, io: dict | None = None) -> dict:
        stage = StageIO.of(io, [col.RESPONSE_IDS, col.SEED], [col.SCORES])
        cols = {c: to_column(c, data[c]) for c in stage.inputs if c in data.keys()}
        return {stage.outputs[0]: self._score(cols, stage.inputs[-1])}

    @register(Dispatch.ALL_TO_ALL)
    def compute_data(self, columns: dict, io: dict) -> dict:
        stage = StageIO.of(io)
        cols = unpack(columns)
        if not cols:
            return {}
        return pack({stage.outputs[0]: self._score(cols, stage.inputs[-1])})
