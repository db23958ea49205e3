"""PPO with a critic: GAE advantages from a learned value function, clipped policy and
value losses. The critic sits with the actor; its values and its update are stages."""
from asyncflow.workflow.stages import Stage


def stages(cfg) -> list[Stage]:
    n = cfg.rollout.n
    batch = cfg.rollout.batch_prompts * n
    step_rows = cfg.trainer.prompts_per_step * n
    ref = []
    out = [
        Stage("rollout", role="rollout", method="generate", inputs=["prompt_ids", "seed"],
              outputs=["response_ids", "behav_log_probs", "token_versions", "gen_version"],
              batch_rows=batch, kind="rollout"),
        Stage("reward", role="reward", method="compute", inputs=["response_ids", "answer"], outputs=["scores"],
              batch_rows=batch),
        Stage("values", role="critic", method="compute_values", inputs=["prompt_ids", "response_ids"],
              outputs=["values"], batch_rows=batch),
    ]
    old = []
    if cfg.algorithm.recompute_proximal:
        out.append(Stage("old_log_prob", role="actor", method="compute_log_probs",
                         inputs=["prompt_ids", "response_ids"], outputs=["old_log_probs"], batch_rows=batch,
                         on_policy_weights=True))
        old = ["old_log_probs"]
    if cfg.algorithm.kl_coef > 0:
        out.append(Stage("ref_log_prob", role="ref", method="compute_log_probs",
                         inputs=["prompt_ids", "response_ids"], outputs=["ref_log_probs"], batch_rows=batch))
        ref = ["ref_log_probs"]
    # The critic learns from the whole step's returns, next to the actor's update.
    out.append(Stage("critic_update", role="critic", method="update",
                     inputs=["prompt_ids", "response_ids", "scores", "values"], outputs=[], batch_rows=step_rows))
    out.append(Stage("update", role="actor", method="update",
                     inputs=["prompt_ids", "response_ids", "scores", "values", "behav_log_probs", *old,
                             "gen_version", *ref], kind="update"))
    return out
