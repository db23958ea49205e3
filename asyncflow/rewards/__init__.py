"""Rewards: verifiable scoring of responses against reference answers.

`REWARDS` maps names to `fn(response, answer, **metadata) -> float` (or a dict with a
`score`); built-ins: exact_match, math, addition, number, digits, and data_source (verl's
routing by the record's data_source). A verl `compute_score` file is used as it is
(`custom.py`). `RewardRunner` scores a batch with timeouts.
"""

from asyncflow.rewards import builtin as _builtin  # noqa: F401 - registers the built-ins
from asyncflow.rewards import data_source as _data_source  # noqa: F401 - registers data_source
from asyncflow.rewards.builtin import addition_reward, exact_match, number_reward, until_eos
from asyncflow.rewards.custom import CustomRewardError, load_file_reward, resolve_reward, reward_ref
from asyncflow.rewards.math_verify import extract_answer, extract_boxed, math_equal, math_reward, normalize
from asyncflow.rewards.registry import (
    REWARDS,
    RewardContractError,
    RewardFn,
    UnknownRewardError,
    get_reward,
    register_reward,
)
from asyncflow.rewards.runner import RewardError, RewardRunner

__all__ = [
    "REWARDS",
    "CustomRewardError",
    "RewardContractError",
    "RewardError",
    "RewardFn",
    "RewardRunner",
    "UnknownRewardError",
    "addition_reward",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "get_reward",
    "load_file_reward",
    "math_equal",
    "math_reward",
    "normalize",
    "number_reward",
    "register_reward",
    "resolve_reward",
    "reward_ref",
    "until_eos",
]
