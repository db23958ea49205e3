"""The built-in rewards: exact_match, math, and addition / number for the built-in task."""

from __future__ import annotations

import re

from asyncflow.rewards.math_verify import math_reward, to_rational
from asyncflow.rewards.registry import register_reward

__all__ = ["addition_reward", "digits_reward", "exact_match", "number_reward", "until_eos"]

DEFAULT_EOS = "<eos>"


def until_eos(response: str, eos: str = DEFAULT_EOS) -> str:
    """The response before the first eos marker (all of it when there is none)."""
    return response.split(eos, 1)[0]


@register_reward("exact_match")
def exact_match(response: str, answer: str, **_: object) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


register_reward("math")(math_reward)


@register_reward("addition")
def addition_reward(response: str, answer: str, eos: str = DEFAULT_EOS, **_: object) -> float:
    """1.0 when the text up to eos is exactly an integer equal to the answer ("046" counts; "46." does not)."""
    text = until_eos(response, eos).strip()
    if not re.fullmatch(r"[-+]?\d+", text):
        return 0.0
    return 1.0 if int(text) == int(answer) else 0.0


@register_reward("number")
def number_reward(response: str, answer: str, eos: str = DEFAULT_EOS, **_: object) -> float:
    """1.0 when the text up to eos is one number (integer, decimal, fraction) equal to the answer."""
    pred = to_rational(until_eos(response, eos))
    gold = to_rational(answer)
    return 1.0 if pred is not None and gold is not None and pred == gold else 0.0


@register_reward("digits")
def digits_reward(response: str, answer: str, eos: str = DEFAULT_EOS, **_: object) -> float:
    """Partial credit: the share of the answer's characters matched position by position, halved
    when the length differs. A denser signal for tests and small budgets; the exact-match
    rewards teach the built-in task better."""
    text = until_eos(response, eos).strip()
    gold = answer.strip()
    if not gold:
        return 0.0
    hits = sum(1 for a, b in zip(text, gold) if a == b) / len(gold)
    return hits if len(text) == len(gold) else hits / 2
