"""RL algorithm pieces as pure tensor functions, each selectable by name through a registry.

Conventions: per-token tensors are padded [B, T] with a ``mask`` [B, T] (bool or 0/1) marking
real response tokens; per-sequence tensors are [B]. Losses are returned per token and reduced
separately with ``aggregate`` so the engine can pass global token/sequence counts.

Every function takes the run's own ``asyncflow.config.AlgorithmConfig`` as its ``cfg`` (one
config tree; no mirrored config classes). ``algorithm_config_problems`` lists its out-of-range
values by key (config loading reports them at start-up); the functions raise them as ValueError.
"""
from __future__ import annotations

from . import policy_loss  # noqa: F401 - imported for its effect: it registers the policy losses
from ._checks import algorithm_config_problems, check_algorithm_config
from .advantages import GROUP_RELATIVE_ADVANTAGES, discounted_returns, outcome_to_token_rewards
from .aggregate import aggregate, count_seqs, count_tokens, masked_mean, masked_sum, masked_var, masked_whiten
from .entropy import entropy_from_logits
from .kl import K3_MAX, kl_penalty_to_reward
from .registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES, Registry
from .rollout_corr import (
    RolloutCorrection,
    mismatch_terms,
    rollout_correction,
    rollout_is_weights,
    rollout_keep_mask,
    rollout_log_ratio,
    sequence_log_ratio,
)
from .value_loss import clipped_value_loss, mse_value_loss

__all__ = [
    "Registry", "ADVANTAGES", "POLICY_LOSSES", "VALUE_LOSSES", "KL_ESTIMATORS", "AGGREGATIONS",
    "GROUP_RELATIVE_ADVANTAGES", "algorithm_config_problems", "check_algorithm_config",
    "aggregate", "masked_sum", "masked_mean", "masked_var", "masked_whiten", "count_tokens", "count_seqs",
    "outcome_to_token_rewards", "discounted_returns",
    "clipped_value_loss", "mse_value_loss",
    "kl_penalty_to_reward", "K3_MAX",
    "entropy_from_logits",
    "RolloutCorrection", "rollout_correction", "rollout_log_ratio", "sequence_log_ratio", "rollout_is_weights",
    "rollout_keep_mask", "mismatch_terms",
]
