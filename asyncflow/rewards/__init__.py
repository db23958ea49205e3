"""Rewards: verifiable scoring of responses against reference answers.

`REWARDS` maps names to `fn(response, answer, **metadata) -> float`; built-ins:
exact_match, math, addition, number. `RewardRunner` scores a batch with timeouts.
"""

from asyncflow.rewards import builtin as _builtin  # noqa: F401 - registers the built-ins
from asyncflow.rewards.builtin import addition_reward, exact_match, number_reward, until_eos
from asyncflow.rewards.math_verify import extract_answer, extract_boxed, math_equal, math_reward, normalize
from asyncflow.rewards.registry import REWARDS, RewardFn, UnknownRewardError, get_reward, register_reward
from asyncflow.rewards.runner import RewardError, RewardRunner

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RewardRunner",
    "UnknownRewardError",
    "addition_reward",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "get_reward",
    "math_equal",
    "math_reward",
    "normalize",
    "number_reward",
    "register_reward",
    "until_eos",
]
