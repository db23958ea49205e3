"""How a rollout instance takes versions in (weight_sync/intake.py): the strategy chosen per
load mode and receiver, what each asks of the service and in which order, and the rollout
worker's bookkeeping of the version it holds. A fake service and engine stand in for the real
ones (the transfers themselves are tested in test_weight_sync_groups.py and tests/engines)."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from asyncflow.weight_sync import intake as I
from asyncflow.weight_sync import sinks
from asyncflow.weight_sync.protocol import make_header


def _done(value):
    fut = Future()
    fut.set_result(value)
    return fut


class FakeEngine:
    def __init__(self, log):
        self.log, self.version, self.last_header = log, 0, None
        self.next_seq = 1  # the publish counter of the version the engine's processes receive next

    def check_weights(self, named, version):
        self.log.append(("check", version, sorted(named)))

    def join_weight_groups(self, addrs, index, timeout_s):
        self.log.append(("join", list(addrs), index, timeout_s))

    def stage_weights(self):
        self.log.append("stage")

    def _loaded(self, what, mode):
        self.log.append((what, mode))
        self.last_header = {"version": self.next_seq, "seq": self.next_seq}
        return {"version": self.next_seq, "seq": self.next_seq, "buckets": 1}

    def swap_staged(self, mode, timeout_s):
        return self._loaded("swap_staged", mode)

    def receive_weights(self, mode):
        return self._loaded("receive", mode)


class FakeService:
    swap_mode = "keep"

    def __init__(self):
        self.log = []
        self.engine = FakeEngine(self.log)

    def call(self, fn, timeout_s, what):
        self.log.append(("call", what, timeout_s))
        return fn(self.engine)

    def update_weights(self, state, version):
        self.log.append(("update_weights", version, sorted(state)))
        return _done({"version": version, "pause_s": 0.0})

    def update_weights_with(self, load, version):
        self.log.append(("update_weights_with", version))
        return _done(load(self.engine))


def _ctx(service, rank=0):
    return I.IntakeContext(service, service.engine, rank, "rollout0", torch.device("cpu"), wire_timeout_s=7.0,
                           call_timeout_s=9.0)


def _header(version, seq):
    named = [("w", torch.full((2, 3), float(version))), ("b", torch.zeros(3))]
    return make_header(named, version, seq, 1 << 20, 1, None), named


def _feed(sink, version, seq):
    """What the sender does for an instance in its process: every tensor of the version."""
    header, named = _header(version, seq)
    sink.begin(header)
    for spec, (_, t) in zip(header.specs, named):
        sink.tensor(spec, t)
    sink.end(header)


@pytest.fixture(autouse=True)
def _own_local_registry(monkeypatch):
    monkeypatch.setattr(sinks, "_LOCAL", [])  # sinks registered here stay out of other tests


@pytest.mark.parametrize("load, engine_receives, cls", [
    ("staged", False, I.Staged), ("in_place", False, I.InPlace),
    ("staged", True, I.EngineStaged), ("in_place", True, I.EngineInPlace)])
def test_one_strategy_per_load_mode_and_receiver(load, engine_receives, cls):
    assert type(I.choose_intake(load, engine_receives, _ctx(FakeService()))) is cls


def test_an_unknown_load_mode_is_refused():
    with pytest.raises(ValueError, match="weight_sync.load 'copy'"):
        I.choose_intake("copy", False, _ctx(FakeService()))


def test_staged_in_process_swaps_each_newer_version_once():
    service = FakeService()
    intake = I.choose_intake("staged", False, _ctx(service, rank=0))
    intake.connect([0, 1], [], 0)
    assert sinks.local_sinks() == [intake.sink] and intake.receiver is None
    intake.receive(1)  # in process: nothing to start, the sender feeds the sink during the publish
    assert intake.swap(1, held=0) is None  # nothing arrived yet
    _feed(intake.sink, version=1, seq=1)
    got = intake.swap(1, held=0)
    assert got == I.Swapped(1, {"version": 1, "pause_s": 0.0})
    assert [e for e in service.log if e[0] == "update_weights"] == [("update_weights", 1, ["b", "w"])]
    assert intake.swap(1, held=1) is None  # taken already
    _feed(intake.sink, version=2, seq=2)
    assert intake.swap(2, held=3) is None  # older than what is held: not loaded
    assert [e[1] for e in service.log if e[0] == "update_weights"] == [1]


def test_in_place_in_process_reports_the_load_the_sender_fed():
    service = FakeService()
    intake = I.choose_intake("in_place", False, _ctx(service, rank=1))
    intake.connect([0, 1], [], 0)
    assert sinks.local_sinks() == [intake.sink]
    assert intake.sink.timeout_s == 7.0  # the sink waits on the wire's timeout
    intake.sink.loaded, intake.sink.result = _header(3, 4)[0], {"version": 3, "pause_s": 0.5}
    assert intake.swap(3, held=2) == I.Swapped(4, {"version": 3, "pause_s": 0.5})
    assert intake.swap(3, held=4) is None


def test_engine_staged_stages_then_loads_at_the_swap():
    service = FakeService()
    intake = I.choose_intake("staged", True, _ctx(service))
    intake.connect([0], [{"a": 1}], 2)
    intake.receive(1)
    assert intake.swap(1, held=0) == I.Swapped(1, {"version": 1, "seq": 1, "buckets": 1})
    assert service.log == [("call", "join_weight_groups", 7.0), ("join", [{"a": 1}], 2, 7.0),
                           ("call", "stage_weights", 9.0), "stage",
                           ("update_weights_with", 1), ("swap_staged", "keep")]
    assert intake.swap(1, held=1) is None  # the engine loaded nothing newer


def test_engine_in_place_loads_at_the_receive_and_the_swap_reports_it():
    service = FakeService()
    intake = I.choose_intake("in_place", True, _ctx(service))
    assert intake.swap(1, held=0) is None  # no receive started: nothing to report
    intake.receive(1)
    assert service.log == [("update_weights_with", 1), ("receive", "keep")]
    assert intake.swap(1, held=0) == I.Swapped(1, {"version": 1, "seq": 1, "buckets": 1})
    assert intake.swap(1, held=1) is None  # reported once


def test_the_rollout_worker_keeps_the_publish_counter_and_refuses_a_version_that_never_came():
    from asyncflow.workers.rollout import RolloutWorker

    class Bare(RolloutWorker):
        rank = 0  # no runtime: the worker's identity is fixed here

    w = Bare.__new__(Bare)
    w.intake, w.seq = None, 0
    with pytest.raises(RuntimeError, match="swap_weights before init_weight_sync"):
        w.swap_weights(1)
    with pytest.raises(RuntimeError, match="receive_weights before init_weight_sync"):
        w.receive_weights(1)
    service = FakeService()
    w.engine, w.intake = service.engine, I.choose_intake("staged", False, _ctx(service))
    w.intake.connect([0], [], 0)
    _feed(w.intake.sink, version=1, seq=1)
    w.engine.version = 0
    assert w.swap_weights(1) == {"version": 1, "pause_s": 0.0} and w.seq == 1
    w.engine.version = 1
    assert w.swap_weights(1) == {"version": 1, "pause_s": 0.0}  # held already: nothing to swap
    with pytest.raises(RuntimeError, match="no newer weights arrived"):
        w.swap_weights(2)


def _feed_later(sink, version, seq, delay_s=0.05):
    """The sender's publish, on a thread of its own, a moment after the take began."""
    import threading
    import time

    def feed():
        time.sleep(delay_s)
        _feed(sink, version, seq)
    th = threading.Thread(target=feed)
    th.start()
    return th


@pytest.mark.parametrize("load", ["staged", "in_place"])
def test_take_in_process_waits_for_the_publish_then_swaps_it_in(load):
    service = FakeService()

    def update_weights_stream(specs, tensors, version):  # the service's loop reads the stream meanwhile
        import threading
        fut = Future()
        threading.Thread(target=lambda: fut.set_result({"version": version, "pause_s": 0.1,
                                                        "n": len(list(tensors))})).start()
        return fut
    service.update_weights_stream = update_weights_stream
    intake = I.choose_intake(load, False, _ctx(service, rank=0))
    intake.connect([0, 1], [], 0)
    feeder = _feed_later(intake.sink, version=2, seq=5)
    got = intake.take(2, held=4)  # called before the publish has fed anything
    feeder.join()
    assert got is not None and got.seq == 5 and got.report["version"] == 2
    assert intake.swap(2, held=5) is None  # taken once


@pytest.mark.parametrize("load", ["staged", "in_place"])
def test_take_in_process_gives_up_after_the_wire_timeout_naming_it(load):
    service = FakeService()
    ctx = I.IntakeContext(service, service.engine, 0, "rollout0", torch.device("cpu"), wire_timeout_s=0.05,
                          call_timeout_s=9.0)
    intake = I.choose_intake(load, False, ctx)
    intake.connect([0, 1], [], 0)
    with pytest.raises(TimeoutError, match=r"rollout0 rank 0 got no version newer than publish 3 in process "
                                            r"within 0 s \(weight_sync.timeout_s\)"):
        intake.take(1, held=3)


def test_take_with_the_engine_receiving_starts_the_receive_then_loads():
    service = FakeService()
    intake = I.choose_intake("staged", True, _ctx(service))
    assert intake.take(1, held=0) == I.Swapped(1, {"version": 1, "seq": 1, "buckets": 1})
    assert service.log == [("call", "stage_weights", 9.0), "stage", ("update_weights_with", 1),
                           ("swap_staged", "keep")]


def test_the_rollout_workers_take_weights_keeps_the_publish_counter():
    from asyncflow.workers.rollout import RolloutWorker

    class Bare(RolloutWorker):
        rank = 0

    w = Bare.__new__(Bare)
    w.intake, w.seq = None, 0
    with pytest.raises(RuntimeError, match="take_weights before init_weight_sync"):
        w.take_weights(1)
    service = FakeService()
    w.engine, w.intake = service.engine, I.choose_intake("staged", False, _ctx(service))
    w.intake.connect([0], [], 0)
    feeder = _feed_later(w.intake.sink, version=1, seq=1)
    w.engine.version = 0
    assert w.take_weights(1) == {"version": 1, "pause_s": 0.0} and w.seq == 1
    feeder.join()
