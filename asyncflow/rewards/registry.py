"""Reward functions by name: `fn(response: str, answer: str, **metadata) -> float`, or a dict
whose `score` is the score and whose other numeric keys are logged (`reward/extra/<key>`).

Built-in rewards register themselves when `asyncflow.rewards` is imported; users add
theirs with `@register_reward("name")` and select them by that name in a config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["REWARDS", "RewardContractError", "RewardFn", "UnknownRewardError", "get_reward", "register_reward"]

RewardFn = Callable[..., Any]  # -> float, or {"score": float, ...}
REWARDS: dict[str, RewardFn] = {}


class UnknownRewardError(ValueError):
    """No reward is registered under the given name."""


class RewardContractError(TypeError):
    """A reward function broke its contract on a row (returned neither a number nor a dict with
    a numeric ``score``; met a row it cannot route). A mistake in the function or the data,
    not a row that failed: the runner raises it whatever ``on_error`` says."""


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; refuses to replace one silently."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_reward: name must be a non-empty string, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}): {fn!r} is not callable")
        old = REWARDS.get(name)
        if old is not None and old is not fn and not overwrite:
            raise ValueError(
                f"register_reward: {name!r} is already registered to {getattr(old, '__qualname__', old)}; "
                f"pick another name or pass overwrite=True"
            )
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name_or_fn: str | RewardFn) -> RewardFn:
    """The function for a registered name; a callable is returned as is."""
    if callable(name_or_fn):
        return name_or_fn
    # the built-ins registered when the package asyncflow.rewards (this module's parent) was imported

    try:
        return REWARDS[name_or_fn]
    except KeyError:
        raise UnknownRewardError(
            f"unknown reward {name_or_fn!r}; registered: {', '.join(sorted(REWARDS))}. "
            f"Register your own with @asyncflow.rewards.register_reward({name_or_fn!r})"
        ) from None
