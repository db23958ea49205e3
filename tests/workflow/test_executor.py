"""The streaming executor against a real TransferQueue, with in-process worker groups that
write their columns the way the real role workers do (the executor is the unit here).

Pins: every row trains exactly once; staleness never exceeds the bound in async mode,
under a slow trainer and under a slow rollout; on-policy modes have staleness 0; async
overlaps rollout of the next step with the update; dynamic sampling refills dropped groups.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq.asyncio

from asyncflow.transfer_queue import AsyncTransferQueueClient, TransferQueueConfig, TransferQueueService
from asyncflow.workflow.driver_stages import equal_score_filter
from asyncflow.workflow.executor import Executor, ExecutorConfig, StepObserver
from asyncflow.workflow.source import PromptSource
from asyncflow.workflow.stages import Stage
from asyncflow.workflow.update_request import UpdateRequest

G = 4  # group size


class Group:
    def __init__(self, tq, role, ranks, delay=0.0):
        self.tq, self.role, self.ranks, self.delay = tq, role, ranks, delay


class Rollout(Group):
    def __init__(self, tq, k, delay, log):
        super().__init__(tq, f"rollout{k}", [k + 1], delay)
        self.version, self.log = 0, log

    async def generate(self, meta, min_version, io=None):
        assert self.version >= min_version, (self.version, min_version)
        self.log.append(("gen", meta.partition, asyncio.get_running_loop().time()))
        await asyncio.sleep(self.delay * len(meta) / 8)
        await self.tq.get_data(meta, ["prompt_ids", "seed"])  # reads its inputs, as a real rollout does
        n = len(meta)
        await self.tq.put({"response_ids": [torch.arange(3) for _ in range(n)],
                           "gen_version": torch.full((n,), self.version, dtype=torch.long),
                           "behav_log_probs": [torch.zeros(3) for _ in range(n)]}, meta.partition, meta)
        return meta

    async def receive_weights(self, v):
        await asyncio.sleep(0.001)
        self.staged = v

    async def swap_weights(self, v):
        self.log.append(("swap_start", self.role, asyncio.get_running_loop().time()))
        await asyncio.sleep(0.001)
        self.log.append(("swap", self.role, asyncio.get_running_loop().time()))
        self.version = self.staged
        return {"version": v, "pause_s": 0.0}


class ServiceRollout(Rollout):
    """A rollout service: takes rows up to its capacity, admits each once it holds the weights
    the row needs, and writes every row to the TransferQueue as soon as that row is done."""

    CAP = 3 * G

    def __init__(self, tq, k, delay, log):
        super().__init__(tq, k, delay, log)
        self.in_flight, self.written, self.submitted = 0, {}, []
        self.changed = asyncio.Event()
        self.tasks = set()

    async def capacity(self):
        return self.CAP

    async def submit(self, meta, min_version, want_free=1, wait_s=5.0, io=None):
        if meta is not None:
            assert self.in_flight + len(meta) <= self.CAP, "the executor overfilled the instance"
            self.in_flight += len(meta)
            self.submitted.append((meta.partition, len(meta)))
            self.tasks.add(asyncio.create_task(self._rows(meta, min_version)))
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while self.CAP - self.in_flight < want_free and loop.time() < end:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), end - loop.time())
            except TimeoutError:
                break
        written, self.written = self.written, {}
        return {"free": self.CAP - self.in_flight, "written": written, "busy_s": dict.fromkeys(written, 0.001)}

    async def _rows(self, meta, min_version):
        while self.version < min_version:  # admission waits for the weights (the staleness gate)
            await asyncio.sleep(0.001)
        version = self.version
        self.log.append(("gen", meta.partition, asyncio.get_running_loop().time()))
        await self.tq.get_data(meta, ["prompt_ids", "seed"])
        for i in range(len(meta)):  # rows finish one by one and leave at once
            await asyncio.sleep(self.delay / 8)
            await self.tq.put({"response_ids": [torch.arange(3)], "gen_version": torch.tensor([version]),
                               "behav_log_probs": [torch.zeros(3)]}, meta.partition, meta.select([i]))
            self.in_flight -= 1
            self.written[meta.partition] = self.written.get(meta.partition, 0) + 1
            self.changed.set()


class Reward(Group):
    def __init__(self, tq, score_fn, delay=0.0):
        super().__init__(tq, "reward", [1], delay)
        self.score_fn = score_fn
        self.sizes = []  # rows per call

    async def compute(self, meta, io=None):
        self.sizes.append(len(meta))
        await asyncio.sleep(self.delay)
        data = await self.tq.get_data(meta, ["seed"])
        scores = [self.score_fn(int(s), g) for s, g in zip(data["seed"].tolist(), meta.groups)]
        await self.tq.put({"scores": torch.tensor(scores, dtype=torch.float32)}, meta.partition, meta)
        return meta


class Actor(Group):
    def __init__(self, tq, delay, log):
        super().__init__(tq, "actor", [0], delay)
        self.version, self.trained, self.staleness, self.log = 0, [], [], log

    async def compute_log_probs(self, meta, io=None):
        assert self.version == int(meta.partition[4:]), "proximal log-probs must use the step's weights"
        n = len(meta)
        await self.tq.put({"old_log_probs": [torch.zeros(3) for _ in range(n)]}, meta.partition, meta)
        return meta

    async def update(self, step, request, io):
        # as the real actor: the group's ranks fetch the step's rows themselves
        req = UpdateRequest.from_wire(request)  # what the executor sends is a valid request
        meta = await self.tq.get_meta(io["inputs"], req.rows, req.task, req.partition,
                                      {"name": "token_balanced", "dp_size": 1}, timeout=req.timeout_s,
                                      dp_group=self.role, dp_rank=0, dp_size=1)
        self.log.append(("update_start", meta.partition, asyncio.get_running_loop().time()))
        data = await self.tq.get_data(meta, ["gen_version", "prompt_index"])
        self.staleness += (step - data["gen_version"]).tolist()
        self.trained += data["prompt_index"].tolist()
        await asyncio.sleep(self.delay)
        self.version = step + 1
        self.log.append(("update_end", meta.partition, asyncio.get_running_loop().time()))
        return [{"reward/mean": 0.0, "rows": float(len(meta))}]

    async def publish_weights(self, v):
        return [{}]


class Critic(Group):
    """A worker stage beside the update that reads the step's rows after a delay (as PPO's
    critic update does, next to the actor's)."""

    def __init__(self, tq, delay):
        super().__init__(tq, "critic", [0], delay)
        self.read = []

    async def update(self, meta, io=None):
        await asyncio.sleep(self.delay)
        data = await self.tq.get_data(meta, ["scores"])  # raises if the step's rows were cleared
        self.read.append((meta.partition, len(data["scores"])))
        return [{"critic/rows": float(len(meta))}]


def records():
    i = 0
    while True:
        yield {"prompt_ids": [1, 2, i % 7], "answer": "x", "index": i}
        i += 1


def stages(dynamic: bool):
    s = [Stage("rollout", "rollout", "generate", ["prompt_ids", "seed"], ["response_ids", "gen_version"],
               batch_rows=2 * G, sampler={"name": "grpo_group", "group_size": G}, kind="rollout"),
         Stage("reward", "reward", "compute", ["response_ids", "seed"], ["scores"], batch_rows=2 * G)]
    gate = []
    if dynamic:
        s.append(Stage("filter", "driver", "", ["scores"], ["accepted"], batch_rows=2 * G,
                       sampler={"name": "grpo_group", "group_size": G}, kind="filter",
                       fn=equal_score_filter("scores")))
        gate = ["accepted"]
    s.append(Stage("old_log_prob", "actor", "compute_log_probs", ["response_ids", *gate], ["old_log_probs"],
                   batch_rows=2 * G, on_policy_weights=True))
    s.append(Stage("update", "actor", "update", ["old_log_probs", "scores", "gen_version", *gate], kind="update"))
    return s


def run(mode, *, steps=5, staleness=1, rollout_delay=0.01, train_delay=0.01, instances=1, dynamic=False,
        score_fn=lambda seed, g: float(seed % 2), service=False, delays=None, critic_delay=None, swaps_at_once=0,
        observers=lambda tq, log: [], wait_timeout_s=20.0, reward_delay=0.0, side_stage=None):
    async def main():
        svc = await TransferQueueService(TransferQueueConfig()).start()
        tq = AsyncTransferQueueClient(svc.controller_address, ctx=zmq.asyncio.Context(), wait_timeout=wait_timeout_s)
        log: list = []
        cls = ServiceRollout if service else Rollout
        insts = [cls(tq, k, (delays or [rollout_delay] * instances)[k], log) for k in range(instances)]
        actor = Actor(tq, train_delay, log)
        groups = {"actor": actor, "reward": Reward(tq, score_fn, reward_delay)}
        plan = stages(dynamic)
        if side_stage is not None:  # a stage the update does not depend on
            plan.insert(-1, side_stage)
        if critic_delay is not None:
            groups["critic"] = Critic(tq, critic_delay)
            plan.insert(-1, Stage("critic_update", "critic", "update", ["scores"], batch_rows=4 * G))
        cfg = ExecutorConfig(mode=mode, max_staleness=staleness, group_size=G, prompts_per_step=4,
                             dynamic_sampling=dynamic, wait_timeout_s=wait_timeout_s, rollout_service=service,
                             swaps_at_once=swaps_at_once)
        src = PromptSource(records(), G, seed=0)
        reports = []

        class Reports(StepObserver):
            async def step_done(self, rep):
                reports.append(rep)

            def holds_training(self, step):
                return False  # as the trainer's metrics: reports beside the next update
        ex = Executor(cfg, plan, groups, insts, tq, src, observers=[Reports(), *observers(tq, log)])
        try:
            await asyncio.wait_for(ex.run(steps), 60)
        finally:
            await tq.close()
            await svc.stop()
        ex.test_instances = insts
        ex.test_groups = groups
        return ex, actor, log, reports
    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
def test_every_prompt_trains_exactly_once(mode):
    ex, actor, _, reports = run(mode)
    assert len(reports) == 5
    assert sorted(actor.trained) == sorted(i for i in range(20) for _ in range(G))


@pytest.mark.parametrize("dynamic", [False, True])
def test_trained_steps_leave_no_bookkeeping_behind(dynamic):
    """A run of days has millions of steps: the driver's memory must not grow with them."""
    ex, _, _, reports = run("async", steps=6, dynamic=dynamic)
    assert len(reports) == 6 and all(r.started <= r.finished for r in reports)
    assert ex.ledger.steps == {} and ex.step_started == {}
    assert all(st.taken == {} and st.low == 6 for st in ex.state.values())


@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_on_policy_modes_are_never_stale(mode):
    _, actor, _, _ = run(mode, rollout_delay=0.02, train_delay=0.05)
    assert set(actor.staleness) == {0}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("slow", ["trainer", "rollout"])
def test_async_staleness_is_bounded(k, slow):
    kw = {"train_delay": 0.15, "rollout_delay": 0.005} if slow == "trainer" else \
        {"train_delay": 0.001, "rollout_delay": 0.08}
    _, actor, _, _ = run("async", steps=6, staleness=k, instances=2, **kw)
    assert max(actor.staleness) <= k
    if slow == "trainer":  # rollout runs ahead as far as the bound lets it
        assert max(actor.staleness) == k


def test_async_overlaps_rollout_with_update():
    _, _, log, _ = run("async", steps=4, train_delay=0.2, rollout_delay=0.01)
    ends = {p: t for e, p, t in log if e == "update_end"}
    gen_next = [t for e, p, t in log if e == "gen" and p == "step2"]
    assert gen_next and min(gen_next) < ends["step1"]  # step 2 generates while update 1 runs


def test_a_stage_behind_takes_the_rows_that_piled_up_in_one_call_within_its_step():
    # The reward is slow and the rollout fast (async: the next step generates meanwhile):
    # while the reward works on one batch the next ones are ready, and its next call takes
    # them together, never rows of two steps.
    ex, actor, _, reports = run("async", steps=4, rollout_delay=0.0, reward_delay=0.2)
    sizes = ex.test_groups["reward"].sizes
    assert len(reports) == 4 and len(actor.trained) == 4 * 4 * G
    assert sum(sizes) == 4 * 4 * G
    assert all(2 * G <= n <= 4 * G for n in sizes)  # at least its batch, at most the step
    assert max(sizes) == 4 * G and len(sizes) < 4 * 2  # fewer calls than batches


def test_sync_takes_the_whole_step_per_call():
    ex, *_ = run("sync", steps=3, reward_delay=0.05)
    assert ex.test_groups["reward"].sizes == [4 * G] * 3


def test_sync_rollout_waits_for_the_update():
    _, _, log, _ = run("sync", steps=3, train_delay=0.1)
    ends = {p: t for e, p, t in log if e == "update_end"}
    gen_next = [t for e, p, t in log if e == "gen" and p == "step2"]
    assert min(gen_next) >= ends["step1"]


def test_dynamic_sampling_refills_dropped_groups():
    # groups with an even uid have all-equal scores: they are dropped and refilled
    ex, actor, _, reports = run("stream", steps=3, dynamic=True, score_fn=lambda seed, g: float(g % 2 and seed % 2))
    assert all(r.rows == 4 * G for r in reports)
    assert len(actor.trained) == 3 * 4 * G
    assert ex.prompts_issued > 12


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
def test_service_rollout_trains_every_row_once(mode):
    ex, actor, _, reports = run(mode, service=True, dynamic=(mode == "stream"))
    assert len(reports) == 5
    assert len(actor.trained) == 5 * 4 * G and len(set(actor.trained)) == len(actor.trained) // G
    if mode != "async":
        assert set(actor.staleness) == {0}


@pytest.mark.parametrize("k", [1, 2])
def test_service_rollout_staleness_is_bounded_and_faster_instance_gets_more(k):
    ex, actor, log, _ = run("async", steps=8, staleness=k, service=True, instances=2, delays=[0.02, 0.12],
                            train_delay=0.02)
    assert max(actor.staleness) <= k
    fast, slow = (sum(n for _, n in inst.submitted) for inst in ex.test_instances)
    assert fast > slow  # pull-based: the instance that frees slots sooner is given more rows
    # swaps go one instance after another
    swaps = [(p, t) for e, p, t in log if e == "swap"]
    assert swaps and all(a[1] <= b[1] for a, b in zip(swaps, swaps[1:]))


def test_service_rollout_rejects_a_capacity_below_one_group(monkeypatch):
    monkeypatch.setattr(ServiceRollout, "CAP", G - 1)
    with pytest.raises(ValueError, match="less than one group"):
        run("async", service=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_stage_beside_the_update_reads_its_rows_before_they_are_cleared(mode):
    ex, actor, _, reports = run(mode, steps=3, train_delay=0.0, critic_delay=0.2)
    assert ex.test_groups["critic"].read == [(f"step{t}", 4 * G) for t in range(3)]
    assert [r.step for r in reports] == [0, 1, 2]


def test_swap_wave_never_takes_every_instance():
    wave = ExecutorConfig().swap_wave
    assert [wave(n) for n in (1, 2, 3, 4, 8, 128)] == [1, 1, 1, 1, 2, 32]  # default: a quarter
    assert [ExecutorConfig(swaps_at_once=k).swap_wave(4) for k in (1, 3, 4, 99)] == [1, 3, 3, 3]


@pytest.mark.parametrize("swaps_at_once, want", [(0, 2), (1, 1), (8, 7)])
def test_instances_swap_in_waves(swaps_at_once, want):
    """8 instances: each version is swapped in by waves of the configured size, and never by all
    8 at once (the rest keep generating)."""
    _, _, log, _ = run("async", steps=4, instances=8, service=True, swaps_at_once=swaps_at_once)
    events = sorted((t, +1 if e == "swap_start" else -1) for e, _, t in log if e in ("swap_start", "swap"))
    assert len(events) >= 2 * 8 * 3  # every instance swapped each new version
    running, most = 0, 0
    for _, d in events:
        running += d
        most = max(most, running)
    assert most == want


class Slow(StepObserver):
    """Reads the step's rows in ``trained`` (they must still be stored), then takes ``delay`` s
    in ``step_done``; holds training on the steps in ``hold``; raises at step ``fail``."""

    def __init__(self, tq, log, delay, hold=(), fail=None):
        self.tq, self.log, self.delay, self.hold, self.fail = tq, log, delay, set(hold), fail

    async def trained(self, step, meta, columns):
        data = await self.tq.get_data(meta, ["scores"])  # raises if the rows were cleared
        assert len(data["scores"]) == len(meta)
        self.log.append(("trained", step, asyncio.get_running_loop().time()))

    async def step_done(self, rep):
        await asyncio.sleep(self.delay)
        if rep.step == self.fail:
            raise RuntimeError(f"observer failed at step {rep.step}")
        self.log.append(("reported", rep.step, asyncio.get_running_loop().time()))

    def holds_training(self, step):
        return step in self.hold


def _times(log, kind):
    return {(int(x[1][4:]) if isinstance(x[1], str) else x[1]): x[2] for x in log if x[0] == kind}


def test_step_reports_run_in_order_beside_the_next_update():
    """Observers that do not hold training report while the next update trains, in step order,
    each step's rows still stored in ``trained``; at most two steps behind; all out by the end."""
    _, _, log, reports = run("async", steps=6, train_delay=0.01,
                             observers=lambda tq, log: [Slow(tq, log, delay=0.05)])
    assert [r.step for r in reports] == list(range(6))
    done, started = _times(log, "reported"), _times(log, "update_start")
    assert sorted(done) == list(range(6)) and sorted(_times(log, "trained")) == list(range(6))
    assert [s for s, _ in sorted(done.items(), key=lambda kv: kv[1])] == list(range(6))  # in order
    assert any(started[t + 1] < done[t] for t in range(5)), "no update overlapped a report"
    assert all(done[t - 2] <= started[t + 1] for t in range(2, 5)), "the reports fell more than two steps behind"


def test_an_observer_that_holds_a_step_holds_the_next_update():
    _, _, log, _ = run("async", steps=4, observers=lambda tq, log: [Slow(tq, log, delay=0.05, hold={1})])
    assert _times(log, "reported")[1] <= _times(log, "update_start")[2]


@pytest.mark.parametrize("hold", [(), range(6)])
def test_a_failing_observer_ends_the_run_with_its_error_at_once(hold):
    # The waits (wait_timeout_s) are far longer than the run's own 60 s limit: a run that went
    # on waiting after the failure would end on that limit (a TimeoutError), never with the
    # observer's error.
    with pytest.raises(RuntimeError, match="observer failed at step 1"):
        run("async", steps=6, observers=lambda tq, log: [Slow(tq, log, delay=0.0, fail=1, hold=hold)],
            wait_timeout_s=600.0)


class Reads(StepObserver):
    """Takes columns of the trained rows through ``reads``; counts the reads of them made
    after the update (the executor's get_columns calls)."""
    reads = ("scores", "prompt_index", "answer", "note")

    def __init__(self, tq):
        self.got, self.after = [], []
        get_columns = tq.get_columns

        async def counted(meta, columns=None):
            if columns and set(columns) <= set(self.reads):  # the fake workers' own reads share the client
                self.after.append(list(columns))
            return await get_columns(meta, columns)
        tq.get_columns = counted

    async def trained(self, step, meta, columns):
        self.got.append((step, len(meta), {c: len(v) for c, v in columns.items()},
                         columns["prompt_index"].data.tolist(), list(columns["answer"].items),
                         columns["note"].data.tolist()))

    def holds_training(self, step):
        return False


def test_observers_get_their_columns_those_written_by_then_with_the_ready_rows():
    """scores (the update depends on it) and prompt_index and answer (the prompt source's) come
    with the request that finds the step's rows ready; note, written by a stage the update does
    not wait for, is read after the update, alone."""
    seen = []
    note = Stage("note", "driver", "", ["scores"], ["note"], batch_rows=2 * G,
                 fn=lambda batch: {"note": torch.full((len(batch),), 7.0)})
    _, actor, _, _ = run("async", steps=3, observers=lambda tq, log: seen.append(Reads(tq)) or seen,
                         side_stage=note)
    obs = seen[0]
    rows = 4 * G
    assert [got[:3] for got in obs.got] == [
        (t, rows, {"scores": rows, "prompt_index": rows, "answer": rows, "note": rows}) for t in range(3)]
    assert sorted(i for got in obs.got for i in got[3]) == sorted(actor.trained)
    assert all(got[4] == ["x"] * rows and got[5] == [7.0] * rows for got in obs.got)
    assert obs.after == [["note"]] * 3


def _slow_note(batch):
    time.sleep(0.2)  # a driver stage the update does not wait for, still computing as the update ends
    return {"note": torch.full((len(batch),), 7.0)}


def test_a_driver_stage_beside_the_update_writes_its_rows_before_the_step_is_reported_and_cleared():
    seen = []
    note = Stage("note", "driver", "", ["scores"], ["note"], batch_rows=4 * G, fn=_slow_note)
    run("async", steps=3, observers=lambda tq, log: seen.append(Reads(tq)) or seen, side_stage=note)
    assert [got[0] for got in seen[0].got] == [0, 1, 2]
    assert all(got[5] == [7.0] * 4 * G for got in seen[0].got)  # read once written, never missing
