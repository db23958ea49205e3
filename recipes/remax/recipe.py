"""ReMax: REINFORCE with the greedy response as each prompt's baseline.

A second rollout stage generates one greedy response per prompt (temperature 0, written to
every row of the prompt's group), the reward scores both, and a driver stage of this recipe
turns ``score - baseline score`` into every token's advantage. No critic, no group
statistics: the baseline is the policy's own best guess.
"""
from __future__ import annotations

import torch

from asyncflow import column_names as col
from asyncflow.workflow.stages import DRIVER, DriverBatch, RecipeSpec, Stage
from recipes.grpo import recipe as grpo


def remax_advantages(batch: DriverBatch) -> dict:
    """Outcome reward minus the greedy baseline's, on every token of the response."""
    gap = batch[col.SCORES].float() - batch["baseline_scores"].float()
    return {col.ADVANTAGES: [torch.full((len(r),), float(g)) for r, g in zip(batch[col.RESPONSE_IDS], gap.tolist())]}


def build(cfg) -> RecipeSpec:
    if cfg.algorithm.dynamic_sampling:
        raise ValueError("recipe remax: set algorithm.dynamic_sampling=false (the greedy baseline, not the "
                         "group, gives each prompt its signal)")
    if cfg.algorithm.kl_in_reward:
        raise ValueError("recipe remax: algorithm.kl_in_reward is not supported (its advantage is score minus "
                         "baseline score); use the KL loss (algorithm.kl_coef with kl_in_reward=false)")
    stages = [
        *grpo.scored_rollout(cfg),
        *grpo.scored_rollout(cfg, name="baseline", outputs=["baseline_ids"], score="baseline_scores",
                             options={"temperature": 0.0, "one_per_group": True}),
        *grpo.log_prob_stages(cfg, []),
        Stage("advantages", role=DRIVER, method="", inputs=[col.SCORES, "baseline_scores", col.RESPONSE_IDS],
              outputs=[col.ADVANTAGES], batch_rows=grpo.batch_rows(cfg), fn=remax_advantages),
        grpo.update(cfg),
    ]
    return RecipeSpec(grpo.roles(cfg), stages)
