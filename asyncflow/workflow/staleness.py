"""The staleness rule, in one place: the rollout of step ``t`` may use the weights of any
policy version ``>= t - k``, with ``k = workflow.max_staleness`` in async mode and ``k = 0``
(on-policy) in sync and stream modes. Every gate on weights (issuing a step, an instance
taking a step's rows, the version a row is admitted under) asks these two functions."""
from __future__ import annotations


def allowed_lag(mode: str, max_staleness: int) -> int:
    """``k``: how many versions behind its step a row's weights may be."""
    return max_staleness if mode == "async" else 0


def min_version(step: int, lag: int) -> int:
    """The oldest policy version the rollout of ``step`` may use (never below version 0)."""
    return max(0, step - lag)
