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


def test_the_extras_of_dict_rewards_are_summed_over_every_group():
    from asyncflow.rewards.runner import extra_means
    from asyncflow.training.phases import reward_totals
    from asyncflow.training.roles import RunRoles
    from asyncflow.workers.rollout import RolloutWorker

    roles = RunRoles(spec=None, placement=None, groups={},
                     instances=[_Group(RolloutWorker, [{"reward/errors": 0, "reward/extra": {"acc": [3.0, 4]}}]),
                                _Group(RolloutWorker, [{"reward/errors": 0, "reward/extra": {"acc": [1.0, 4],
                                                                                             "len": [9.0, 3]}}])])
    failures, extra = asyncio.run(reward_totals(roles))
    assert failures == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    assert extra == {"acc": [4.0, 8], "len": [9.0, 3]}
    assert extra_means(extra) == {"acc": 0.5, "len": 3.0}


def test_an_evaluation_logs_the_extras_of_the_training_rows_since_the_last_one_and_its_own(tmp_path):
    """reward/extra/<key>: the training rows scored since the previous evaluation row (none new: left
    out); eval/extra/<key>: this evaluation's rows; the evaluation scores with reward.custom_path."""
    from asyncflow.config import load_config
    from asyncflow.rewards.custom import file_ref
    from asyncflow.training.phases import Evaluator
    from asyncflow.training.roles import RunRoles
    from asyncflow.workers.reward import RewardWorker
    from asyncflow.workers.rollout import RolloutWorker

    class _Instance(_Group):
        def __init__(self):
            super().__init__(RolloutWorker, [{}])
            self.rewards = []

        async def evaluate(self, prompts, answers, reward, **_):
            self.rewards.append(reward)
            return {"accuracy": 0.5, "version": 0, "examples": [], "reward_errors": 0, "reward_timeouts": 0,
                    "reward_extra": {"acc": 0.5}}

    class _Log:
        def __init__(self):
            self.rows = []

        def log(self, step, row):
            self.rows.append(row)

    stats = [{"reward/errors": 0, "reward/extra": {"acc": [2.0, 4]}}]
    inst = _Instance()
    roles = RunRoles(spec=None, placement=None, groups={"reward": _Group(RewardWorker, stats)}, instances=[inst])
    cfg = load_config(None, [f"reward.custom_path={tmp_path / 'r.py'}"])
    logger = _Log()
    evaluate = Evaluator(cfg, roles, logger, [{"prompt_ids": [1], "answer": "1", "prompt": "p", "metadata": {}}])
    asyncio.run(evaluate(0, "before_rl"))
    asyncio.run(evaluate(1, "rl"))  # nothing scored since
    stats[0] = {"reward/errors": 0, "reward/extra": {"acc": [5.0, 8]}}
    asyncio.run(evaluate(2, "rl"))
    assert [r.get("reward/extra/acc") for r in logger.rows] == [0.5, None, 0.75]
    assert all(r["eval/extra/acc"] == 0.5 for r in logger.rows)
    assert inst.rewards == [file_ref(str(tmp_path / "r.py"), "compute_score")] * 3
