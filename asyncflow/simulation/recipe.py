"""The simulation recipe: GRPO as the paper runs it (rollout, reward, actor and reference
log-probs, advantages, update), declared with the real ``Role`` and ``Stage`` so the real
executor drives it; only the worker classes are simulated.

Batch sizes follow the data-parallel sizes, as one would configure a real run: a map stage
on the training ranks takes ``rows_per_device_call`` rows per rank per call, so the calls
per step do not grow with the cluster while the rows do.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import column_names as col
from ..config import AlgorithmConfig
from ..workflow import driver_stages
from ..workflow.stages import DRIVER, RecipeSpec, Role, Stage, check_graph, check_roles

SOURCE_COLUMNS = [col.PROMPT_IDS, col.ANSWER, col.SEED, col.PROMPT_INDEX, col.PROMPT, col.METADATA, col.MAX_NEW_TOKENS]
UPDATE_INPUTS = [col.PROMPT_IDS, col.RESPONSE_IDS, col.ADVANTAGES, col.BEHAV_LOG_PROBS, col.OLD_LOG_PROBS,
                 col.REF_LOG_PROBS, col.SCORES, col.GEN_VERSION, col.SEED]


@dataclass
class RecipeSizes:
    group_size: int = 8
    rollout_rows: int = 16  # rows per rollout call (sync: the step is split over the instances)
    map_rows: int = 64  # rows per call of the reward, log-prob and advantage stages


def build(sizes: RecipeSizes, where: str = "asyncflow/simulation/recipe.py") -> RecipeSpec:
    group = {"name": "grpo_group", "group_size": sizes.group_size}
    roles = {
        "actor": Role("asyncflow.simulation.workers:SimActorWorker", on="actor"),
        "ref": Role("asyncflow.simulation.workers:SimReferenceWorker", on="actor"),
        "reward": Role("asyncflow.simulation.workers:SimRewardWorker", on="rollout"),
        "rollout": Role("asyncflow.simulation.workers:SimRolloutWorker", on="rollout", per_rank=True),
    }
    pair = [col.PROMPT_IDS, col.RESPONSE_IDS]
    stages = [
        Stage("rollout", role="rollout", method="generate", inputs=[col.PROMPT_IDS, col.SEED, col.MAX_NEW_TOKENS],
              outputs=[col.RESPONSE_IDS, col.BEHAV_LOG_PROBS, col.TOKEN_VERSIONS, col.GEN_VERSION],
              batch_rows=sizes.rollout_rows, sampler=group, kind="rollout"),
        Stage("reward", role="reward", method="compute", inputs=[col.RESPONSE_IDS, col.SEED], outputs=[col.SCORES],
              batch_rows=sizes.map_rows),
        Stage("old_log_prob", role="actor", method="compute_log_probs", inputs=pair, outputs=[col.OLD_LOG_PROBS],
              batch_rows=sizes.map_rows, on_policy_weights=True),
        Stage("ref_log_prob", role="ref", method="compute_log_probs", inputs=pair, outputs=[col.REF_LOG_PROBS],
              batch_rows=sizes.map_rows),
        Stage("advantages", role=DRIVER, method="", inputs=[col.SCORES, col.RESPONSE_IDS], outputs=[col.ADVANTAGES],
              batch_rows=sizes.map_rows, sampler=group, fn=driver_stages.advantages(AlgorithmConfig())),
        Stage("update", role="actor", method="update", inputs=UPDATE_INPUTS, kind="update"),
    ]
    spec = RecipeSpec(roles, stages)
    check_graph(spec.stages, SOURCE_COLUMNS, where)
    check_roles(spec, where)
    return spec
