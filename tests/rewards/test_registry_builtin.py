"""Reward registry and the built-in rewards."""
from __future__ import annotations

import pytest

from asyncflow.rewards import REWARDS, UnknownRewardError, get_reward, register_reward


def test_builtins_registered():
    assert {"exact_match", "math", "addition", "number"} <= set(REWARDS)


def test_unknown_name_lists_registered():
    with pytest.raises(UnknownRewardError, match=r"unknown reward 'nope'; registered: .*addition.*exact_match.*math"):
        get_reward("nope")


def test_register_user_reward(monkeypatch):
    monkeypatch.setattr("asyncflow.rewards.registry.REWARDS", dict(REWARDS))
    from asyncflow.rewards import registry

    @register_reward("length")
    def length(response: str, answer: str, **meta) -> float:
        return float(len(response) == int(answer))

    assert registry.get_reward("length") is length
    assert registry.get_reward(length) is length
    with pytest.raises(ValueError, match="'length' is already registered"):
        register_reward("length")(lambda r, a, **m: 0.0)
    register_reward("length", overwrite=True)(replacement := (lambda r, a, **m: 1.0))
    assert registry.get_reward("length") is replacement


@pytest.mark.parametrize("name,response,answer,expected", [
    ("exact_match", " 46 \n", "46", 1.0),
    ("exact_match", "46.", "46", 0.0),
    ("addition", "46", "46", 1.0),
    ("addition", "46<eos>", "46", 1.0),
    ("addition", "46<eos>junk", "46", 1.0),
    ("addition", "046", "46", 1.0),
    ("addition", "47<eos>", "46", 0.0),
    ("addition", "4<eos>6", "46", 0.0),
    ("addition", "46+1", "46", 0.0),
    ("addition", "", "46", 0.0),
    ("addition", "<eos>", "0", 0.0),
    ("number", "0.5<eos>", "1/2", 1.0),
    ("number", "12", "12.0", 1.0),
    ("number", "twelve", "12", 0.0),
    ("math", r"\boxed{46}", "46", 1.0),
])
def test_builtin_rewards(name, response, answer, expected):
    assert get_reward(name)(response, answer) == expected


def test_addition_custom_eos():
    assert get_reward("addition")("46</s>xx", "46", eos="</s>") == 1.0


def test_digits_gives_partial_credit():
    from asyncflow.rewards import REWARDS
    f = REWARDS["digits"]
    assert f("46", "46") == 1.0
    assert f("45", "46") == 0.5
    assert f("4", "46") == 0.25  # half the characters, wrong length
    assert f("", "46") == 0.0
    assert f("46<eos>junk", "46") == 1.0
