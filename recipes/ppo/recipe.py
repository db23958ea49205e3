"""PPO with a critic: GAE advantages from a learned value function, clipped policy and
value losses, several optimizer steps per batch (algorithm.ppo_epochs passes over
mini-batches of algorithm.ppo_mini_batch_size prompts). The critic sits with the actor;
its values, the advantages (and the critic's returns) and its update are stages."""
from __future__ import annotations

from asyncflow import column_names as col
from asyncflow.workflow.stages import RecipeSpec, Role, Stage
from recipes.grpo import recipe as grpo


def build(cfg) -> RecipeSpec:
    roles = {**grpo.roles(cfg), "critic": Role("asyncflow.workers.critic:CriticWorker", on="actor")}
    batch = grpo.batch_rows(cfg)
    stages = [*grpo.scored_rollout(cfg),
              Stage("values", role="critic", method="compute_values", inputs=[col.PROMPT_IDS, col.RESPONSE_IDS],
                    outputs=[col.VALUES], batch_rows=batch)]
    stages += grpo.log_prob_stages(cfg, [])
    stages.append(grpo.advantage(cfg, [col.SCORES, col.RESPONSE_IDS, col.VALUES],
                                 outputs=[col.ADVANTAGES, col.RETURNS]))
    # The critic learns from the whole step's returns, next to the actor's update.
    stages.append(Stage("critic_update", role="critic", method="update",
                        inputs=[col.PROMPT_IDS, col.RESPONSE_IDS, col.VALUES, col.RETURNS],
                        batch_rows=cfg.trainer.prompts_per_step * cfg.rollout.n))
    stages.append(grpo.update(cfg))
    return RecipeSpec(roles, stages)
