"""``reward.name=data_source``: each row scored by the rule for its record's ``data_source``,
the routing verl's default scorer does when no ``custom_reward_function`` is given, for the
common math sets:

- GSM8K (``openai/gsm8k``): the number after the response's last ``####`` equals the answer
  (1.0), else 0.0; a response without ``####`` scores 0.0, as verl's strict GSM8K rule does.
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``)
  and DeepScaleR (``agentica-org/DeepScaleR-Preview-Dataset``, not one of verl's defaults): the
  response's last ``\\boxed{...}`` equals the answer, exactly or through math-verify (1.0),
  else 0.0; a response without ``\\boxed`` scores 0.0.

A row whose data_source has no rule stops the run naming it (any other set needs its own
function: ``reward.custom_path``); a run's data is checked for such rows when it starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from asyncflow.rewards.math_verify import extract_boxed, math_equal, to_rational
from asyncflow.rewards.registry import RewardContractError, register_reward

__all__ = ["SCORERS", "boxed_math_score", "data_source_reward", "gsm8k_score", "scorer_for", "unrouted"]

_GSM8K_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def gsm8k_score(response: str, answer: str) -> float:
    """1.0 when the number after the last ``####`` equals the answer (commas ignored)."""
    found = _GSM8K_FINAL.findall(response)
    if not found:
        return 0.0
    pred, gold = to_rational(found[-1].replace(",", "")), to_rational(answer.replace(",", ""))
    return 1.0 if pred is not None and pred == gold else 0.0


def boxed_math_score(response: str, answer: str) -> float:
    """1.0 when the last ``\\boxed{...}`` of the response equals the (boxed or bare) answer."""
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    gold = extract_boxed(answer) if "\\boxed" in answer else answer
    return 1.0 if math_equal(pred, gold if gold is not None else answer) else 0.0


SCORERS: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": boxed_math_score,
    "DigitalLearningGmbH/MATH-lighteval": boxed_math_score,
    "HuggingFaceH4/MATH-500": boxed_math_score,
    "agentica-org/DeepScaleR-Preview-Dataset": boxed_math_score,
}


def scorer_for(data_source: Any) -> Callable[[str, str], float]:
    """The rule for a data_source; RewardContractError naming it when there is none."""
    scorer = SCORERS.get(data_source) if isinstance(data_source, str) else None
    if scorer is None:
        what = "a row without data_source" if data_source is None else f"data_source {data_source!r}"
        raise RewardContractError(f"reward.name=data_source: no rule for {what}; known: {', '.join(SCORERS)}. "
                                  "Give the set's own function with reward.custom_path")
    return scorer


def unrouted(data_sources: Iterable[Any]) -> list[Any]:
    """The distinct data_sources (in first-seen order) that have no rule."""
    out: list[Any] = []
    for ds in data_sources:
        if ds not in out and (not isinstance(ds, str) or ds not in SCORERS):
            out.append(ds)
    return out


@register_reward("data_source")
def data_source_reward(response: str, answer: str, data_source: Any = None, **_: object) -> float:
    return scorer_for(data_source)(response, answer)
