"""Placement planning (``asyncflow plan``): parameter count, memory per device and role, and
the rollout/training split a cost model predicts fastest. Pure functions on dataclasses;
nothing here imports torch or transformers (the built-in tiny model's shape excepted)."""
from asyncflow.planning.hardware import PRESETS, Hardware
from asyncflow.planning.memory import RoleMemory, actor_memory, kv_bytes_per_token, reference_memory, rollout_memory
from asyncflow.planning.params import ModelShape, ParamCount, PlanInputError, count_params, load_config_json
from asyncflow.planning.planner import Plan, make_plan
from asyncflow.planning.settings import CostAssumptions, PlacementRequest, RolloutSettings, TrainSettings, Workload
from asyncflow.planning.split import Candidate, PlanInputs

__all__ = ["PRESETS", "Candidate", "CostAssumptions", "Hardware", "ModelShape", "ParamCount", "Plan", "PlanInputError",
           "PlanInputs", "PlacementRequest", "RoleMemory", "RolloutSettings", "TrainSettings", "Workload",
           "actor_memory", "count_params", "kv_bytes_per_token", "load_config_json", "make_plan", "reference_memory",
           "rollout_memory"]
