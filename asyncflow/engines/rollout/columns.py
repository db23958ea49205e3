"""A rollout stage's output columns from finished rows: the stage declares its output names,
which stand, in order, for the response ids, their behaviour log-probs, each token's policy
version and the row's version (its oldest token's); a stage that declares fewer writes
only those. Episodes add their own columns after these (asyncflow.agents.runner)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import column_names as col

ROLLOUT_OUTPUTS = [col.RESPONSE_IDS, col.BEHAV_LOG_PROBS, col.TOKEN_VERSIONS, col.GEN_VERSION]


def positional_columns(names: Sequence[str], makers: Sequence[Callable[[], Any]], what: str) -> dict:
    """``{names[i]: makers[i]()}``; more names than makers is an error naming ``what``."""
    if len(names) > len(makers):
        raise ValueError(f"{what} writes at most {len(makers)} columns; it declares {list(names)}")
    return {name: makers[i]() for i, name in enumerate(names)}


def result_columns(results: Sequence[Any], fallback_version: int, outputs: Sequence[str] | None = None,
                   extra: Sequence[Callable[[], Any]] = (), what: str = "a rollout stage") -> dict:
    """The columns of ``results`` (anything with response_ids, log_probs, token_versions and
    gen_version: request results, trajectories), in their order; ``extra`` makes the columns
    past the four rollout ones."""
    makers = [
        lambda: [r.response_ids for r in results],
        lambda: [r.log_probs.float() for r in results],
        lambda: [r.token_versions for r in results],
        lambda: torch.tensor([r.gen_version if r.gen_version is not None else fallback_version
                              for r in results], dtype=torch.long),
        *extra,
    ]
    return positional_columns(ROLLOUT_OUTPUTS if outputs is None else list(outputs), makers, what)
