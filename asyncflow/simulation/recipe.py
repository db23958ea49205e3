"""The simulation recipe: GRPO as the paper runs it (rollout, reward, actor and reference
log-probs, advantages, update), declared with the real ``Role`` and ``Stage`` so the real
executor drives it; only the worker classes are simulated.

Batch sizes follow the data-parallel sizes, as one would configure a real run: a map stage
on the training ranks takes ``rows_per_device_call`` rows per rank per call, so the calls
per step do not grow with the cluster while the rows do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import AlgorithmConfig
from ..workflow import driver_stages
from ..workflow.stages import DRIVER, RecipeSpec, Role, Stage, check_graph, check_roles

SOURCE_COLUMNS = ["prompt_ids", "answer", "seed", "prompt_index", "prompt", "metadata", "max_new_tokens"]
UPDATE_INPUTS = ["prompt_ids", "response_ids", "advantages", "behav_log_probs", "old_log_probs", "ref_log_probs",
                 "scores", "gen_version", "seed"]


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
    pair = ["prompt_ids", "response_ids"]
    stages = [
        Stage("rollout", role="rollout", method="generate", inputs=["prompt_ids", "seed", "max_new_tokens"],
              outputs=["response_ids", "behav_log_probs", "token_versions", "gen_version"],
              batch_rows=sizes.rollout_rows, sampler=group, kind="rollout"),
        Stage("reward", role="reward", method="compute", inputs=["response_ids", "seed"], outputs=["scores"],
              batch_rows=sizes.map_rows),
        Stage("old_log_prob", role="actor", method="compute_log_probs", inputs=pair, outputs=["old_log_probs"],
              batch_rows=sizes.map_rows, on_policy_weights=True),
        Stage("ref_log_prob", role="ref", method="compute_log_probs", inputs=pair, outputs=["ref_log_probs"],
              batch_rows=sizes.map_rows),
        Stage("advantages", role=DRIVER, method="", inputs=["scores", "response_ids"], outputs=["advantages"],
              batch_rows=sizes.map_rows, sampler=group, fn=driver_stages.advantages(AlgorithmConfig())),
        Stage("update", role="actor", method="update", inputs=UPDATE_INPUTS, kind="update"),
    ]
    spec = RecipeSpec(roles, stages)
    check_graph(spec.stages, SOURCE_COLUMNS, where)
    check_roles(spec, where)
    return spec
