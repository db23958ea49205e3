"""GRPO: group-relative advantages, clipped policy loss, no critic.

``build`` declares the whole algorithm: the roles (worker classes and where they run) and
the stages with the columns each reads and writes; the executor overlaps the stages. Copy
this folder to start a new algorithm; the pieces below (``roles``, ``scored_rollout``,
``log_prob_stages``, ``advantage``, ``update``) are plain functions other recipes import
(``from recipes.grpo.recipe import roles``).
"""
from __future__ import annotations

from collections.abc import Sequence

from asyncflow import column_names as col
from asyncflow.algorithms import GROUP_RELATIVE_ADVANTAGES
from asyncflow.workflow import driver_stages
from asyncflow.workflow.stages import DRIVER, RecipeSpec, Role, Stage


def batch_rows(cfg) -> int:
    return cfg.rollout.batch_prompts * cfg.rollout.n


def groups(cfg) -> dict:
    """The sampler of stages that need whole groups (a prompt's n responses together)."""
    return {"name": "grpo_group", "group_size": cfg.rollout.n}


def roles(cfg) -> dict[str, Role]:
    """The policy (trained, on the training ranks), the rollout instances (one per generation
    rank), the reward (a rule, or a reward model when reward.model_path is set; none when the
    rollout scores inline) and, with a KL term, the frozen reference."""
    out = {
        "actor": Role("asyncflow.workers.actor:ActorWorker", on="actor"),
        "rollout": Role("asyncflow.workers.rollout:RolloutWorker", on="rollout", per_rank=True),
    }
    if not reward_inline(cfg):
        out["reward"] = Role("asyncflow.workers.reward_model:RewardModelWorker" if cfg.reward.model_path
                             else "asyncflow.workers.reward:RewardWorker", on=cfg.placement.reward_with)
    ref = reference_role(cfg)
    if ref is not None:
        out["ref"] = ref
    return out


def reference_role(cfg) -> Role | None:
    """The frozen reference model's role, with a KL term (kl_coef > 0). None without one, and
    with LoRA (model.lora.rank), whose reference is the policy with its adapters off: the
    actor computes it, and no second model is built."""
    if cfg.algorithm.kl_coef <= 0 or cfg.model.lora.rank is not None:
        return None
    return Role("asyncflow.workers.reference:ReferenceWorker", on=cfg.placement.ref_with)


def reward_inline(cfg) -> bool:
    """The rollout instances score their own rows (placement.reward_with=inline)."""
    return cfg.placement.reward_with == "inline"


def rollout(cfg, name: str = "rollout", outputs: list[str] | None = None, options: dict | None = None) -> Stage:
    budget = [col.MAX_NEW_TOKENS] if cfg.rollout.length_profile else []  # per-row token budgets (benchmarks)
    return Stage(name, role="rollout", method="generate", inputs=[col.PROMPT_IDS, col.SEED, *budget],
                 outputs=outputs or [col.RESPONSE_IDS, col.BEHAV_LOG_PROBS, col.TOKEN_VERSIONS, col.GEN_VERSION],
                 batch_rows=batch_rows(cfg), sampler=groups(cfg), kind="rollout", options=options or {})


def reward(cfg, name: str = "reward", response: str = col.RESPONSE_IDS, output: str = col.SCORES) -> Stage:
    """Scores of ``response``: the rule sees the decoded text, the answer, the prompt text and
    the record's metadata; a reward model sees prompt and response tokens."""
    if reward_inline(cfg):
        raise ValueError(f"stage {name!r}: placement.reward_with=inline has no reward stage; build the "
                         "rollout and its scores with scored_rollout(cfg, ...)")
    inputs = [col.PROMPT_IDS, response] if cfg.reward.model_path else [response, col.ANSWER, col.PROMPT, col.METADATA]
    return Stage(name, role="reward", method="compute", inputs=inputs, outputs=[output], batch_rows=batch_rows(cfg))


def scored_rollout(cfg, name: str = "rollout", outputs: list[str] | None = None, options: dict | None = None,
                   score: str = col.SCORES, reward_name: str = "") -> list[Stage]:
    """A rollout stage and the scores of its responses (column ``score``): one stage that
    scores each row as it finishes when the reward is inline, else the rollout and a reward
    stage (named ``reward_name``, default "reward" for the main rollout, "<name>_reward")."""
    gen = rollout(cfg, name, outputs, options)
    if not reward_inline(cfg):
        return [gen, reward(cfg, reward_name or ("reward" if name == "rollout" else f"{name}_reward"),
                            response=gen.outputs[0], output=score)]
    gen.inputs = [*gen.inputs, col.ANSWER, col.PROMPT, col.METADATA]
    gen.outputs = [*gen.outputs, score]
    gen.options = {**gen.options, "score_into": score}
    return [gen]


def log_prob_stages(cfg, gate: list[str]) -> list[Stage]:
    """Proximal log-probs (algorithm.recompute_proximal) and the reference's (kl_coef > 0)."""
    out = []
    if cfg.algorithm.recompute_proximal:
        out.append(Stage("old_log_prob", role="actor", method="compute_log_probs",
                         inputs=[col.PROMPT_IDS, col.RESPONSE_IDS, *gate], outputs=[col.OLD_LOG_PROBS],
                         batch_rows=batch_rows(cfg), on_policy_weights=True))
    if cfg.algorithm.kl_coef > 0:
        lora = cfg.model.lora.rank is not None  # the actor's model with its adapters off (reference_role)
        out.append(Stage("ref_log_prob", role="actor" if lora else "ref",
                         method="compute_ref_log_probs" if lora else "compute_log_probs",
                         inputs=[col.PROMPT_IDS, col.RESPONSE_IDS, *gate], outputs=[col.REF_LOG_PROBS],
                         batch_rows=batch_rows(cfg)))
    return out


def advantage(cfg, inputs: list[str], outputs: Sequence[str] = (col.ADVANTAGES,), score: str = col.SCORES) -> Stage:
    """Advantages once per row, in the driver. Group estimators take whole groups as they are
    ready; the others (whitening over the batch) take the whole step."""
    a = cfg.algorithm
    if cfg.rollout.n == 1 and a.advantage in GROUP_RELATIVE_ADVANTAGES:
        raise ValueError(f"rollout.n=1 with algorithm.advantage={a.advantage}: a group-relative estimator compares "
                         "each response with the other responses to its prompt, so one response per prompt gives "
                         "every row advantage 0 and nothing is learned; set rollout.n >= 2, or pick an estimator "
                         "that needs no group (reinforce_pp, gae)")
    extra = []
    if a.kl_in_reward and a.kl_coef > 0:
        extra = [col.REF_LOG_PROBS, col.OLD_LOG_PROBS if a.recompute_proximal else col.BEHAV_LOG_PROBS]
    grouped = a.advantage in GROUP_RELATIVE_ADVANTAGES
    return Stage("advantages", role=DRIVER, method="", inputs=[*inputs, *extra], outputs=list(outputs),
                 batch_rows=batch_rows(cfg) if grouped else 0, sampler=groups(cfg) if grouped else "sequential",
                 fn=driver_stages.advantages(a, score=score))


def update(cfg, extra: Sequence[str] = ()) -> Stage:
    """The policy update: reads advantages and the log-probs the loss needs (and each token's
    policy version, for the rollout_corr/ mismatch figures on the trainer's own version)."""
    a = cfg.algorithm
    cols = [col.PROMPT_IDS, col.RESPONSE_IDS, col.ADVANTAGES, col.BEHAV_LOG_PROBS, col.SCORES, col.GEN_VERSION,
            col.TOKEN_VERSIONS]
    if a.recompute_proximal:
        cols.append(col.OLD_LOG_PROBS)
    if a.kl_coef > 0 and not a.kl_in_reward:
        cols.append(col.REF_LOG_PROBS)
    return Stage("update", role="actor", method="update", inputs=[*cols, *extra], kind="update")


def build(cfg) -> RecipeSpec:
    stages = scored_rollout(cfg)
    gate = []  # with dynamic sampling, later stages see only the groups the filter kept
    if cfg.algorithm.dynamic_sampling:
        stages.append(Stage("filter", role=DRIVER, method="", inputs=[col.SCORES], outputs=[col.ACCEPTED],
                            batch_rows=batch_rows(cfg), sampler=groups(cfg), kind="filter",
                            fn=driver_stages.equal_score_filter(col.SCORES)))
        gate = [col.ACCEPTED]
    stages += log_prob_stages(cfg, gate)
    stages.append(advantage(cfg, [col.SCORES, col.RESPONSE_IDS, *gate]))
    stages.append(update(cfg))
    return RecipeSpec(roles(cfg), stages)
