"""fault.*: the restart policy of lost rollout instances, refused at start naming the key, and
the placements where an instance can be replaced."""
from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow.config import ConfigError, load_config

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "grpo" / "config.yaml"
APART = ["trainer.nproc=3", "placement.mode=disaggregated", "placement.actor_ranks=[0]",
         "placement.rollout_ranks=[1,2]", "placement.reward_with=actor"]


@pytest.mark.parametrize("overrides,key", [
    (["fault.max_restarts_per_instance=-1"], "fault.max_restarts_per_instance: must be >= 0"),
    (["fault.max_restarts_per_run=-2"], "fault.max_restarts_per_run: must be >= 0"),
    (["fault.backoff_s=-1"], "fault.backoff_s: must be >= 0"),
    (["fault.backoff_s=5", "fault.max_backoff_s=1"], "fault.max_backoff_s: must be >= fault.backoff_s"),
    (["fault.rejoin_timeout_s=0"], "fault.rejoin_timeout_s: must be > 0"),
    (["fault.max_restarts_per_run=lots"], "fault.max_restarts_per_run"),
    (["fault.rollout_restarts=true", "placement.mode=colocated"], ("fault.rollout_restarts: needs placement.mode="
                                                                   "disaggregated")),
    (["fault.rollout_restarts=true", *APART, "placement.rollout_ranks=[0,1]"], "fault.rollout_restarts: needs"),
    (["fault.rollout_restarts=true", *APART, "placement.ref_with=rollout"], "fault.rollout_restarts: the reference"),
])
def test_bad_fault_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GRPO, overrides)


def test_off_by_default_and_on_with_instances_apart():
    f = load_config(GRPO).fault
    assert not f.rollout_restarts and f.max_restarts_per_instance == 3 and f.max_restarts_per_run == 10
    on = load_config(GRPO, ["fault.rollout_restarts=true", *APART, "fault.backoff_s=0.5"]).fault
    assert on.rollout_restarts and on.backoff_s == 0.5


def test_the_reward_may_share_the_rollout_ranks_its_lost_share_scored_again():
    """GRPO's own placement (reward_with=rollout): one reward worker per rollout rank (training/replicas.py)."""
    cfg = load_config(GRPO, ["fault.rollout_restarts=true", *APART, "placement.reward_with=rollout"])
    assert cfg.fault.rollout_restarts and cfg.placement.reward_with == "rollout"
