"""How a rollout instance takes each version in: one strategy per way, chosen once when the
instance joins weight sync (``choose_intake``), so that the rollout worker's
``receive_weights`` and ``swap_weights`` are the same two calls whatever the way.

- ``Staged`` (``weight_sync.load=staged``): the version goes into a second set of tensors
  (sinks.StagingSink) while generation goes on; ``swap`` has the service copy it in at the
  next step boundary.
- ``InPlace`` (``in_place``): the version goes straight into the engine's weights while it
  arrives, generation paused (sinks.InPlaceSink, or the receiver's stream); ``swap`` reports it.
  Both take the tensors in process when a training rank shares the instance's process (the
  sender feeds the sink), else from a receive.BucketReceiver of the instance's own.
- ``EngineStaged`` / ``EngineInPlace`` (the engine receives): the engine's own processes join
  the groups and receive (vLLM's workers, engines/rollout/vllm_worker.py); the instance only
  tells the engine, through its service, when to receive and when to load.

``swap(version, held)`` returns what it swapped in (the version's publish counter and the
service's report), or None when no version newer than the one held (``held``) arrived.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .protocol import TensorSpec, WeightHeader
from .receive import BucketReceiver
from .sinks import LOAD_MODES, InPlaceSink, StagingSink, register_local
from .wire_group import WireGroup


@dataclass(frozen=True)
class IntakeContext:
    """The rollout instance a strategy serves."""
    service: Any  # its RolloutService (engines/rollout/service.py)
    engine: Any  # the service's engine
    rank: int
    role: str
    device: torch.device
    wire_timeout_s: float  # weight_sync.timeout_s: joining the groups, every receive, an in-place feed
    call_timeout_s: float  # the instance's calls into its service: a load, a swap


@dataclass(frozen=True)
class Swapped:
    seq: int  # the publish counter of the weights now held
    report: dict[str, Any]  # the service's report of the swap (version, pause_s, ...)


class WeightIntake(Protocol):
    def connect(self, train_ranks: list[int], addrs: list[Any], index: int) -> None:
        """Join the training ranks' groups (``addrs``) as member ``index``, or register for the
        tensors in process; returns once every group is complete."""

    def receive(self, version: int) -> None:
        """Start receiving ``version`` in the background (before the policy publishes it)."""

    def swap(self, version: int, held: int) -> Swapped | None:
        """Wait for the version received and swap it in; None: nothing newer than ``held``."""

    def take(self, version: int, held: int) -> Swapped | None:
        """``receive`` and ``swap`` in one call, made while the policy publishes (not before it):
        waits for the version to arrive, then swaps it in; None as ``swap``."""


class _WorkerReceives:
    """The instance's own process receives: in process from a training rank that shares it
    (the sender feeds ``sink``), else over the wire with a BucketReceiver."""

    def __init__(self, ctx: IntakeContext, sink: Any):
        self.ctx, self.sink = ctx, sink
        self.receiver: BucketReceiver | None = None

    def connect(self, train_ranks: list[int], addrs: list[Any], index: int) -> None:
        c = self.ctx
        if c.rank in train_ranks:
            register_local(self.sink)
            return
        groups = {k: WireGroup(a, index, c.wire_timeout_s, device=c.device) for k, a in enumerate(addrs)}
        self.receiver = BucketReceiver(c.rank, c.role, train_ranks, groups, c.wire_timeout_s, c.device)

    def receive(self, version: int) -> None:
        if self.receiver is not None:  # else the sender hands the tensors over during the publish
            self.receiver.start(version, self._load, self._dest())

    def swap(self, version: int, held: int) -> Swapped | None:
        raise NotImplementedError

    def take(self, version: int, held: int) -> Swapped | None:
        self.receive(version)
        # In process the publish feeds the sink, and this call may come before it: wait for it.
        # (Over the wire, swap joins the receiver, which waits for the sender.)
        if self.receiver is None and not self.sink.wait_newer(held, self.ctx.wire_timeout_s):
            raise TimeoutError(f"weight sync: {self.ctx.role} rank {self.ctx.rank} got no version newer than "
                               f"publish {held} in process within {self.ctx.wire_timeout_s:.0f} s "
                               f"(weight_sync.timeout_s)")
        return self.swap(version, held)

    def _load(self, header: WeightHeader, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _dest(self) -> Any:
        return None


class Staged(_WorkerReceives):
    def __init__(self, ctx: IntakeContext):
        super().__init__(ctx, StagingSink(ctx.engine.check_weights, ctx.device))

    def _load(self, header: WeightHeader, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
        self.sink.begin(header)
        for spec, t in tensors:
            self.sink.tensor(spec, t)
        self.sink.end(header)

    def _dest(self) -> Any:
        return self.sink.bucket_buffer  # buckets land in the staging tensors' own bytes

    def swap(self, version: int, held: int) -> Swapped | None:
        if self.receiver is not None:
            self.receiver.join()
        got = self.sink.take()
        if got is None or got[0].seq <= held:
            return None
        header, staging = got
        report = self.ctx.service.update_weights(staging, header.version).result(self.ctx.call_timeout_s)
        return Swapped(header.seq, report)


class InPlace(_WorkerReceives):
    def __init__(self, ctx: IntakeContext):
        super().__init__(ctx, InPlaceSink(ctx.service, ctx.wire_timeout_s))
        self._loaded: tuple[Any, Any] = (None, None)  # (header, the service's report) of the receiver's last load

    def _load(self, header: WeightHeader, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
        fut = self.ctx.service.update_weights_stream(header.specs, tensors, header.version)
        self._loaded = (header, fut.result(self.ctx.call_timeout_s))

    def swap(self, version: int, held: int) -> Swapped | None:
        # loaded while it arrived, generation paused: only the report is left
        if self.receiver is not None:
            self.receiver.join()
            header, report = self._loaded
        else:
            header, report = self.sink.loaded, self.sink.result
        self._loaded = (None, None)
        if header is None or header.seq <= held:
            return None
        return Swapped(header.seq, report)


class _EngineReceives:
    """The engine's own processes join every training rank's group, one member each."""

    def __init__(self, ctx: IntakeContext):
        self.ctx = ctx
        self._pending: Any = None  # the service's Future of the load under way

    def connect(self, train_ranks: list[int], addrs: list[Any], index: int) -> None:
        c = self.ctx
        c.service.call(lambda e: e.join_weight_groups(addrs, index, c.wire_timeout_s), c.wire_timeout_s,
                       "join_weight_groups")

    def receive(self, version: int) -> None:
        raise NotImplementedError

    def swap(self, version: int, held: int) -> Swapped | None:
        raise NotImplementedError

    def take(self, version: int, held: int) -> Swapped | None:
        # the engine's processes receive on their own: start it, then load as a swap does
        self.receive(version)
        return self.swap(version, held)

    def _swapped(self, held: int) -> Swapped | None:
        report = self._pending.result(self.ctx.call_timeout_s) if self._pending is not None else None
        self._pending = None
        head = self.ctx.engine.last_header  # the header of the version the engine loaded last
        if report is None or head is None or head["seq"] <= held:
            return None
        return Swapped(int(head["seq"]), report)


class EngineStaged(_EngineReceives):
    def receive(self, version: int) -> None:
        # the engine's processes receive it on a thread while they generate
        self.ctx.service.call(lambda e: e.stage_weights(), self.ctx.call_timeout_s, "stage_weights")
        self._pending = None

    def swap(self, version: int, held: int) -> Swapped | None:
        # loaded from their staged copies at a step boundary
        service, timeout = self.ctx.service, self.ctx.call_timeout_s
        self._pending = service.update_weights_with(lambda e: e.swap_staged(service.swap_mode, timeout), version)
        return self._swapped(held)


class EngineInPlace(_EngineReceives):
    def receive(self, version: int) -> None:
        # generation pauses at the next step boundary while the engine's processes receive and load
        service = self.ctx.service
        self._pending = service.update_weights_with(lambda e: e.receive_weights(service.swap_mode), version)

    def swap(self, version: int, held: int) -> Swapped | None:
        return self._swapped(held)


_STRATEGIES: dict[tuple[str, bool], Callable[[IntakeContext], WeightIntake]] = {
    ("staged", False): Staged, ("in_place", False): InPlace,
    ("staged", True): EngineStaged, ("in_place", True): EngineInPlace,
}


def choose_intake(load: str, engine_receives: bool, ctx: IntakeContext) -> WeightIntake:
    """The strategy for ``weight_sync.load`` (``load``); ``engine_receives``: the engine's own
    processes join the groups (vLLM with no training rank in the instance's process)."""
    if load not in LOAD_MODES:
        raise ValueError(f"weight_sync.load {load!r}: expected one of {LOAD_MODES}")
    return _STRATEGIES[(load, bool(engine_receives))](ctx)
