"""GRPO: group-relative advantages, clipped policy loss, no critic.

The stages below are the whole algorithm's data flow; the executor overlaps them.
Copy this folder to start a new algorithm: change the stages, or name another
advantage / loss from asyncflow.algorithms in config.yaml.
"""
from asyncflow.workflow.stages import Stage


def stages(cfg) -> list[Stage]:
    n = cfg.rollout.n
    batch = cfg.rollout.batch_prompts * n
    groups = {"name": "grpo_group", "group_size": n}
    budget = ["max_new_tokens"] if cfg.rollout.length_profile else []  # per-row token budgets (benchmarks)
    gate = []  # with dynamic sampling, later stages see only the groups the filter kept
    out = [
        Stage("rollout", role="rollout", method="generate", inputs=["prompt_ids", "seed", *budget],
              outputs=["response_ids", "behav_log_probs", "token_versions", "gen_version"],
              batch_rows=batch, sampler=groups, kind="rollout"),
        Stage("reward", role="reward", method="compute", inputs=["response_ids", "answer"], outputs=["scores"],
              batch_rows=batch),
    ]
    if cfg.algorithm.dynamic_sampling:
        out.append(Stage("filter", role="driver", method="", inputs=["scores"], outputs=["accepted"],
                         batch_rows=batch, sampler=groups, kind="filter"))
        gate = ["accepted"]
    old = []
    if cfg.algorithm.recompute_proximal:
        out.append(Stage("old_log_prob", role="actor", method="compute_log_probs",
                         inputs=["prompt_ids", "response_ids", *gate], outputs=["old_log_probs"],
                         batch_rows=batch, on_policy_weights=True))
        old = ["old_log_probs"]
    ref = []
    if cfg.algorithm.kl_coef > 0:
        out.append(Stage("ref_log_prob", role="ref", method="compute_log_probs",
                         inputs=["prompt_ids", "response_ids", *gate], outputs=["ref_log_probs"], batch_rows=batch))
        ref = ["ref_log_probs"]
    out.append(Stage("update", role="actor", method="update",
                     inputs=["prompt_ids", "response_ids", "scores", "behav_log_probs", *old,
                             "gen_version", *ref, *gate], kind="update"))
    return out
