"""DAPO: GRPO with dynamic sampling (groups whose rewards are all equal are dropped and
refilled from new prompts), asymmetric clip-higher, token-level loss, no KL, and the soft
overlong punishment: responses running into the last ``reward.overlong_buffer`` tokens of
the budget lose part of their score, in a driver stage before the filter and advantages."""
from __future__ import annotations

from asyncflow import column_names as col
from asyncflow.workflow import driver_stages
from asyncflow.workflow.stages import DRIVER, RecipeSpec, Stage
from recipes.grpo import recipe as grpo


def build(cfg) -> RecipeSpec:
    if not cfg.algorithm.dynamic_sampling:
        raise ValueError("recipe dapo: algorithm.dynamic_sampling must stay true (it is what DAPO is)")
    r = cfg.reward
    stages = grpo.scored_rollout(cfg)
    score = col.SCORES
    if r.overlong_buffer > 0:
        stages.append(Stage("overlong", role=DRIVER, method="", inputs=[col.SCORES, col.RESPONSE_IDS],
                            outputs=["shaped_scores"], batch_rows=grpo.batch_rows(cfg),
                            fn=driver_stages.overlong_shaping(cfg.rollout.max_new_tokens, r.overlong_buffer,
                                                              r.overlong_penalty)))
        score = "shaped_scores"
    stages.append(Stage("filter", role=DRIVER, method="", inputs=[score], outputs=[col.ACCEPTED],
                        batch_rows=grpo.batch_rows(cfg), sampler=grpo.groups(cfg), kind="filter",
                        fn=driver_stages.equal_score_filter(score)))
    stages += grpo.log_prob_stages(cfg, [col.ACCEPTED])
    stages.append(grpo.advantage(cfg, [score, col.RESPONSE_IDS, col.ACCEPTED], score=score))
    stages.append(grpo.update(cfg))
    return RecipeSpec(grpo.roles(cfg), stages)
