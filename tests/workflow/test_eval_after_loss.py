"""With fault.rollout_restarts, a held-out evaluation survives a lost rollout instance: its
share of the prompts is evaluated again on an instance that answered, and its reward counts
are left out (they went with its process); any other failure is raised as it is."""
from __future__ import annotations

import asyncio

import pytest

from asyncflow.single_controller.errors import WorkerDiedError
from asyncflow.training.phases import evaluate_surviving_loss, reward_totals


class _Inst:
    def __init__(self, name: str, lost: bool = False, fails: Exception | None = None):
        self.name, self.lost, self.fails, self.got = name, lost, fails, []

    async def reward_stats(self):
        if self.lost:
            raise WorkerDiedError(f"{self.name} is lost")
        return [{"reward/errors": 1, "reward/timeouts": 2}]


async def _evaluate(inst: _Inst, part: list[int]):
    inst.got.append(part)
    if inst.fails is not None:
        raise inst.fails
    if inst.lost:
        raise WorkerDiedError(f"{inst.name} is lost")
    return {"by": inst.name, "part": part}


def test_a_lost_instances_share_is_evaluated_on_one_that_answered():
    a, b, c = _Inst("a"), _Inst("b", lost=True), _Inst("c")
    replies = asyncio.run(evaluate_surviving_loss([(a, [0, 1]), (b, [2, 3]), (c, [4])], _evaluate))
    assert [r["part"] for r in replies] == [[0, 1], [2, 3], [4]]  # every share, in its place
    assert replies[1]["by"] == "a" and b.got == [[2, 3]] and a.got == [[0, 1], [2, 3]]


def test_no_instance_answered_or_another_failure_is_raised():
    with pytest.raises(WorkerDiedError, match="a is lost"):
        asyncio.run(evaluate_surviving_loss([(_Inst("a", lost=True), [0]), (_Inst("b", lost=True), [1])],
                                            _evaluate))
    with pytest.raises(ValueError, match="bad reward"):
        asyncio.run(evaluate_surviving_loss([(_Inst("a", fails=ValueError("bad reward")), [0]),
                                             (_Inst("b", lost=True), [1])], _evaluate))


class _Roles:
    def __init__(self, instances):
        self.instances = instances

    def with_method(self, name, instances=False):
        return list(self.instances)


def test_reward_counts_leave_a_lost_instance_out_only_with_faults_on():
    roles = _Roles([_Inst("a"), _Inst("b", lost=True)])
    total, _ = asyncio.run(reward_totals(roles, lost_ok=True))
    assert total == {"reward/errors": 1.0, "reward/timeouts": 2.0}
    with pytest.raises(WorkerDiedError, match="b is lost"):
        asyncio.run(reward_totals(roles))
