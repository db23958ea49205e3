"""The run's reward failures are summed over every group that counts them: the reward stage's
workers, and the rollout instances when they score their own rows (reward_with=inline)."""
from __future__ import annotations

import asyncio


class _Group:
    """What reward_failures reads of a started worker group: its class and reward_stats."""

    def __init__(self, cls: type, stats: list[dict]):
        self.cls, self._stats = cls, stats

    async def reward_stats(self) -> list[dict]:
        return self._stats


def test_rollout_instances_scoring_inline_are_counted():
    from asyncflow.training.phases import reward_failures
    from asyncflow.training.roles import RunRoles
    from asyncflow.workers.actor import ActorWorker
    from asyncflow.workers.reward import RewardWorker
    from asyncflow.workers.rollout import RolloutWorker

    inline = RunRoles(spec=None, placement=None, groups={"actor": _Group(ActorWorker, [])},
                      instances=[_Group(RolloutWorker, [{"reward/errors": 2, "reward/timeouts": 1}]),
                                 _Group(RolloutWorker, [{"reward/errors": 3, "reward/timeouts": 0}])])
    assert asyncio.run(reward_failures(inline)) == {"reward/errors": 5.0, "reward/timeouts": 1.0}
    staged = RunRoles(spec=None, placement=None,
                      groups={"reward": _Group(RewardWorker, [{"reward/errors": 1}, {"reward/errors": 1}])},
                      instances=[_Group(RolloutWorker, [{"reward/errors": 0, "reward/timeouts": 0}])])
    assert asyncio.run(reward_failures(staged)) == {"reward/errors": 2.0, "reward/timeouts": 0.0}
