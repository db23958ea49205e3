"""The names of the TransferQueue columns that more than one package reads or writes.

A recipe's stages declare the columns they read and write by name; the source, the role
workers and the driver's stages read and write those columns. The names they share are
defined here, once: a recipe, a worker and a stage that spell a column by its constant
cannot disagree. A recipe may add columns of its own (``baseline_ids``) as plain strings.

Code imports the module, not its names (``from asyncflow import column_names as col``;
``col.PROMPT_IDS``): a column's name then never clashes with a registry or a local of the
same spelling (``asyncflow.algorithms.ADVANTAGES`` is the estimators' registry). A function
that imports it so keeps ``col`` for the module (its locals say ``column``).

This module imports nothing, so every layer of asyncflow (data, engines, agents,
workflow, workers, training) and every recipe can use it.
"""
from __future__ import annotations

from typing import Final

# Written by the prompt source, one row per response (a prompt's n rows share these).
PROMPT_IDS: Final = "prompt_ids"  # the prompt's token ids
PROMPT: Final = "prompt"  # the prompt's text (rule rewards see it)
ANSWER: Final = "answer"  # the reference answer (rule rewards compare against it)
METADATA: Final = "metadata"  # the record's other fields, a dict per row
SEED: Final = "seed"  # the row's sampling seed
PROMPT_INDEX: Final = "prompt_index"  # the record's index in the data set
MAX_NEW_TOKENS: Final = "max_new_tokens"  # a per-row token budget (length profiles)

# Written by a rollout stage, in this order (its default names; a stage may declare others).
RESPONSE_IDS: Final = "response_ids"  # the response's token ids
BEHAV_LOG_PROBS: Final = "behav_log_probs"  # per token: log-prob under the weights that sampled it
TOKEN_VERSIONS: Final = "token_versions"  # per token: the policy version that sampled it
GEN_VERSION: Final = "gen_version"  # per row: its oldest token's policy version
# ... and after those four, by an episode (multi-turn) rollout stage:
LOSS_MASK: Final = "loss_mask"  # per token: 1 = model token, 0 = tool/env text
SCORES: Final = "scores"  # per row: the reward (also a reward stage's, or an inline-scored rollout's)
EPISODE: Final = "episode"  # per row: an episode's metrics, finish reason and turn starts

ACCEPTED: Final = "accepted"  # per row: kept by a filter stage (dynamic sampling)

# Per token, from the training side.
OLD_LOG_PROBS: Final = "old_log_probs"  # proximal: under the weights the update starts from
REF_LOG_PROBS: Final = "ref_log_probs"  # under the frozen reference
VALUES: Final = "values"  # the critic's value estimates
RETURNS: Final = "returns"  # the critic's regression targets
ADVANTAGES: Final = "advantages"  # what the policy loss weighs each token by
