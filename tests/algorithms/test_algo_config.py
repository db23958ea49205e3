"""The run's AlgorithmConfig is the algorithms' config: its values are checked at load time,
by key, with the rules the algorithm functions enforce when called directly."""
from __future__ import annotations

import pytest

from asyncflow.algorithms import algorithm_config_problems
from asyncflow.config import AlgorithmConfig, ConfigError, load_config


def test_defaults_are_valid_and_follow_verl() -> None:
    cfg = AlgorithmConfig()
    assert algorithm_config_problems(cfg) == []
    assert (cfg.unbiased_std, cfg.eps, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c, cfg.max_log_ratio) == \
        (True, 1e-6, 0.2, 0.2, 3.0, 20.0)
    assert load_config().algorithm == cfg


@pytest.mark.parametrize("override, key", [
    ("algorithm.gamma=1.5", "algorithm.gamma"), ("algorithm.lam=-0.1", "algorithm.lam"),
    ("algorithm.eps=0", "algorithm.eps"), ("algorithm.clip_low=1.0", "algorithm.clip_low"),
    ("algorithm.clip_high=-0.1", "algorithm.clip_high"), ("algorithm.dual_clip_c=1", "algorithm.dual_clip_c"),
    ("algorithm.is_cap=0", "algorithm.is_cap"), ("algorithm.tis_cap=-1", "algorithm.tis_cap"),
    ("algorithm.max_log_ratio=0", "algorithm.max_log_ratio"), ("algorithm.gamma=nan", "algorithm.gamma"),
])
def test_bad_value_is_a_config_error_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"{key}: must be" in str(e.value), str(e.value)


def test_every_bad_key_is_reported_once() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.gamma=2", "algorithm.eps=-1"])
    assert str(e.value).count("algorithm.gamma") == 1 and str(e.value).count("algorithm.eps") == 1


def test_new_keys_load_and_vanilla_is_accepted() -> None:
    cfg = load_config(None, ["algorithm.policy_loss=vanilla", "algorithm.unbiased_std=false",
                             "algorithm.whiten=false", "algorithm.eps=1e-8", "algorithm.tis_cap=1.5"])
    a = cfg.algorithm
    assert (a.policy_loss, a.unbiased_std, a.whiten, a.eps, a.tis_cap) == ("vanilla", False, False, 1e-8, 1.5)
    with pytest.raises(ConfigError, match="algorithm.policy_loss: 'vanila' is not registered"):
        load_config(None, ["algorithm.policy_loss=vanila"])
