"""A reward name the registry lacks fails at config load, listing the registered ones."""
from __future__ import annotations

import pytest

from asyncflow.config import ConfigError, load_config


def test_an_unknown_reward_name_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.name=nosuch"])
    msg = str(info.value)
    assert "reward.name: 'nosuch' is not registered; known:" in msg
    for name in ("addition", "exact_match", "math", "number"):
        assert name in msg
