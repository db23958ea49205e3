"""The simulation's model without processes: the engine's time accounting, the throughput
window, the terms that make scaling sub-linear, and the verdict on printed figures."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.simulation.clock import SimClock
from asyncflow.simulation.cluster import ClusterConfig, _Recorder
from asyncflow.simulation.costs import CostModel
from asyncflow.simulation.driver_data import columns_before
from asyncflow.simulation.engine import SimRequestEngine
from asyncflow.simulation.recipe import SOURCE_COLUMNS, RecipeSizes, build
from asyncflow.simulation.stragglers import slowdowns, slowest
from asyncflow.simulation.verdict import judge
from asyncflow.workflow.executor import StepReport

COSTS = CostModel.named("qwen2.5-7b")


def _request(i: int, budget: int, prompt: int = 100) -> GenerationRequest:
    return GenerationRequest(("r", i), list(range(prompt)), SamplingParams(max_new_tokens=budget), i, budget, 0)


def test_a_row_admitted_mid_step_gets_no_time_from_before_its_admission():
    eng = SimRequestEngine(COSTS, SimClock(1.0), capacity=4)
    eng._mark = 0.0
    eng.add_request(_request(0, 100))
    eng._admit_waiting()  # into an idle engine: starts at once, prefill owed
    a = eng.running[0]
    prefill = COSTS.prefill_s(100)
    dt = eng._step_s()
    t = prefill + 2.5 * dt
    eng._spend(t)  # two steps done, half of the third
    assert a.done == 2 and 0 < eng._credit < eng._step_s()
    eng.add_request(_request(1, 100))
    eng._admit_waiting()
    b = eng.joining[0]
    assert eng.running == [a]  # b waits for the step in progress to end
    t += eng._step_s() - eng._credit + 1e-12  # the step in progress ends: b joins now, its prefill owed
    eng._spend(t)
    assert a.done == 3 and b.done == 0 and eng.running == [a, b] and eng._credit < 1e-9
    dt2 = eng._step_s()
    t += prefill + 0.99 * dt2  # not enough for a step of both: the half step before b came is not b's
    eng._spend(t)
    assert a.done == 3 and b.done == 0
    t += 0.02 * dt2
    eng._spend(t)
    assert a.done == 4 and b.done == 1


def test_an_idle_engine_keeps_no_time():
    eng = SimRequestEngine(COSTS, SimClock(1.0), capacity=4)
    eng._mark = 0.0
    eng._spend(100.0)  # idle for 100 s
    eng.add_request(_request(0, 10))
    eng._admit_waiting()
    eng._spend(100.0 + COSTS.prefill_s(100))
    assert eng.running[0].done == 0


def test_the_window_leaves_out_warm_up_and_tail_steps():
    cfg = ClusterConfig(mode="async", warm_steps=2, measured_steps=3, max_staleness=1)
    assert cfg.steps == 6 and [s for s in range(cfg.steps) if cfg.in_window(s)] == [2, 3, 4]
    sync = ClusterConfig(mode="sync", warm_steps=2, measured_steps=3)
    assert sync.steps == 5 and [s for s in range(sync.steps) if sync.in_window(s)] == [2, 3, 4]

    class Run:
        def __init__(self) -> None:
            self.cfg, self.begin, self.end, self.events, self.step = cfg, None, None, [], None

        async def mark(self) -> int:
            self.events.append(("mark", self.step))
            return self.step

        def measuring(self, on: bool) -> None:
            self.events.append(("measuring", on))

    run = Run()
    rec = _Recorder(run)

    async def feed() -> None:
        for step in range(cfg.steps):
            run.step = step
            await rec.step_done(StepReport(step, {}, {}, 32, 0.0, 0.0))
    asyncio.run(feed())
    # opened when warm-up step 1 ended, closed when step 4 ended; the tail step 5 changes nothing
    assert run.begin == 1 and run.end == 4
    assert run.events == [("mark", 1), ("measuring", True), ("mark", 4), ("measuring", False)]
    with pytest.raises(ValueError, match="measured_steps"):
        ClusterConfig(measured_steps=0)


def _train_step_s(c: CostModel, ranks: int, tokens: float = 10_000.0, draws: int = 300) -> float:
    """Mean time of a weak-scaling update step (the same tokens per rank) over many seeded steps."""
    stragglers = sum(slowest(0, f"step{k}", ranks, c.straggler_sigma) for k in range(draws)) / draws
    return c.train_s(tokens) * stragglers + c.grad_sync_s(ranks)


def test_collective_latency_and_stragglers_make_weak_scaling_sub_linear():
    ideal = replace(COSTS, link_latency_s=0.0, straggler_sigma=0.0)
    latency_only = replace(COSTS, straggler_sigma=0.0)
    stragglers_only = replace(COSTS, link_latency_s=0.0)

    def efficiency(c: CostModel, n: int) -> float:  # throughput per rank at n over that at 8 ranks
        return _train_step_s(c, 8) / _train_step_s(c, n)

    # the bandwidth term alone is nearly flat: 2(n-1)/n tends to 2
    assert efficiency(ideal, 128) > 0.9
    for c in (latency_only, stragglers_only, COSTS):
        effs = [efficiency(c, n) for n in (16, 32, 64, 128)]
        assert all(e < 1 for e in effs) and effs == sorted(effs, reverse=True), (c, effs)
        assert efficiency(c, 128) < efficiency(ideal, 128)
    assert efficiency(COSTS, 128) < min(efficiency(latency_only, 128), efficiency(stragglers_only, 128))
    assert latency_only.allreduce_s(128, 1e9) - ideal.allreduce_s(128, 1e9) == pytest.approx(
        2 * 127 * 5e-6 * 40)  # 2(n-1) hops per 25 MB bucket


def test_straggler_draws_are_seeded_and_the_collective_waits_for_the_slowest():
    a, b = slowdowns(3, "train:1", 16, 0.05), slowdowns(3, "train:1", 16, 0.05)
    assert a == b and a != slowdowns(3, "train:2", 16, 0.05)
    assert slowest(3, "train:1", 16, 0.05) == max(a) > 1.0
    assert slowdowns(3, "x", 4, 0.0) == [1.0] * 4


def test_a_nodes_instances_share_its_link_for_the_weights():
    lat = COSTS.link_latency_s * 609  # 15.2 GB in 25 MB buckets
    one = COSTS.weight_sync_s(instances=1, train_devices=8)
    assert one - lat == pytest.approx(COSTS.model.weight_bytes / (COSTS.rank_gbps * 1e9))  # its own port
    eight = COSTS.weight_sync_s(instances=8, train_devices=8)  # one training node's link carries 8 copies
    assert eight == pytest.approx(one)
    sixteen = COSTS.weight_sync_s(instances=16, train_devices=8)  # ... or 16: each arrives at half the speed
    assert sixteen - lat == pytest.approx(2 * (one - lat))
    assert COSTS.weight_sync_s(instances=128, train_devices=128) == pytest.approx(eight)  # weak scaling: flat
    narrow = replace(COSTS, node_gbps=100.0)  # a node whose link is narrower than its devices' ports
    assert narrow.weight_sync_s(8, 16) - lat == pytest.approx(COSTS.model.weight_bytes / 12.5e9)


def test_a_verdict_is_judged_on_the_printed_figure():
    missed = judge("linearity_16x_async", 0.849, 0.85)
    assert not missed.met and missed.printed == "0.849"
    assert not judge("linearity_16x_async", 0.8494, 0.85).met
    assert judge("linearity_16x_async", 0.857, 0.85).met
    assert judge("controller_busy_at_max", 0.06, 0.5, higher_is_better=False).met
    assert not judge("controller_busy_at_max", 0.5, 0.5, higher_is_better=False).met
    assert "NOT met" in missed.line() and "0.849" in missed.line()


def test_a_dataproto_driver_carries_every_column_the_rows_have_by_each_stage():
    before = columns_before(build(RecipeSizes()).stages, SOURCE_COLUMNS)
    assert before[("response_ids", "behav_log_probs", "token_versions", "gen_version")] == SOURCE_COLUMNS
    update = before[()]
    for c in ("response_ids", "scores", "old_log_probs", "ref_log_probs", "advantages", *SOURCE_COLUMNS):
        assert c in update
    ref = before[("ref_log_probs",)]  # depends on the rollout only: the reward may not have run yet
    assert "response_ids" in ref and "scores" not in ref and "old_log_probs" not in ref
