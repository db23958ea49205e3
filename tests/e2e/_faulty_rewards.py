"""Reward functions that misbehave, imported by the workers of the fault tests (`imports=`)."""
from __future__ import annotations

import time

from asyncflow.rewards import register_reward

_calls = [0]


@register_reward("test_hangs_once")
def hangs_once(response: str, answer: str, **_: object) -> float:
    """The third call in each process hangs far past any sane timeout."""
    _calls[0] += 1
    if _calls[0] == 3:
        time.sleep(60)
    return float(response.strip() == answer)


@register_reward("test_raises")
def raises(response: str, answer: str, **_: object) -> float:
    raise ConnectionError("reward backend unavailable")
