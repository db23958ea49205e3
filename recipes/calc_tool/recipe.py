"""A multi-turn, tool-using recipe: GRPO over calculator episodes (asyncflow/data/calc.py).

The rollout stage runs one episode per row (``episode.py``): its trajectory (model turns
and the calculator's output, with a loss mask that keeps the tool's text out of the loss)
and its reward are written as the row's columns. No reward stage: the episode scores itself.
Copy this folder for an agent of your own: write the episode, register your tools in a
module the config lists under ``imports``.
"""
from __future__ import annotations

from asyncflow import column_names as col
from asyncflow.agents.runner import EPISODE_OUTPUTS
from asyncflow.workflow import driver_stages
from asyncflow.workflow.stages import DRIVER, RecipeSpec, Role, Stage
from recipes.grpo import recipe as grpo

EPISODE = "recipes.calc_tool.episode:calc_episode"


def build(cfg, episode: str = EPISODE) -> RecipeSpec:
    roles = {"actor": Role("asyncflow.workers.actor:ActorWorker", on="actor"),
             "rollout": Role("asyncflow.workers.rollout:RolloutWorker", on="rollout", per_rank=True)}
    stages = [Stage("rollout", role="rollout", method="generate",
                    inputs=[col.PROMPT_IDS, col.SEED, col.ANSWER, col.PROMPT], outputs=list(EPISODE_OUTPUTS),
                    batch_rows=grpo.batch_rows(cfg), sampler=grpo.groups(cfg),
                    kind="rollout", options={"episode": episode})]
    gate = []
    if cfg.algorithm.dynamic_sampling:
        stages.append(Stage("filter", role=DRIVER, method="", inputs=[col.SCORES], outputs=[col.ACCEPTED],
                            batch_rows=grpo.batch_rows(cfg), sampler=grpo.groups(cfg), kind="filter",
                            fn=driver_stages.equal_score_filter(col.SCORES)))
        gate = [col.ACCEPTED]
    stages += grpo.log_prob_stages(cfg, gate)
    stages.append(grpo.advantage(cfg, [col.SCORES, col.RESPONSE_IDS, col.LOSS_MASK, *gate]))
    stages.append(grpo.update(cfg, extra=[col.LOSS_MASK]))
    ref = grpo.reference_role(cfg)
    if ref is not None:
        roles["ref"] = ref
    return RecipeSpec(roles, stages)
