"""The run's configuration: omegaconf structured dataclasses, a recipe yaml, key=value overrides.

A wrong key or a value of the wrong type fails at start-up with the key's path and what
was expected (``ConfigError``), before any process starts. The parts:

- ``sections``: one dataclass per section, each checking its own values (``validate()``);
- ``run``: ``RunConfig``, the tree of sections;
- ``checks``: the rules that tie sections together, run once when the config loads;
- ``loading``: ``load_config`` (yaml <- overrides, typed and checked), ``to_dict`` / ``from_dict``;
- ``derived``: values derived from a config (resolved once by the launcher into
  ``asyncflow.resolved.ResolvedRun``, which the driver and the workers read).

Every name users import from ``asyncflow.config`` stays importable from here.
"""
from __future__ import annotations

from ..algorithm_config import AlgorithmConfig
from ..platform import usable_cpus
from ..single_controller.tq_units import TransferQueueLayout
from .checks import check
from .derived import offload_idle, policy_loss_name, rank_threads, rollout_devices, rollout_dtype
from .fields import ConfigError, one_of
from .loading import from_dict, load_config, to_dict
from .run import RunConfig
from .sections import (
    OFFLOAD_IDLE,
    AgentConfig,
    DataConfig,
    FaultConfig,
    LoraConfig,
    ModelConfig,
    OpenAIEndpointConfig,
    OptimConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
    WarmupConfig,
    WeightSyncConfig,
    WorkflowConfig,
)

UnitsConfig = TransferQueueLayout  # deprecated: the transfer_queue section's former name

__all__ = [
    "OFFLOAD_IDLE", "AgentConfig", "AlgorithmConfig", "ConfigError", "DataConfig", "FaultConfig", "LoraConfig",
    "ModelConfig", "OpenAIEndpointConfig", "OptimConfig", "PlacementConfig", "RewardConfig", "RolloutConfig",
    "RunConfig", "TinyModelConfig", "TrainerConfig", "TransferQueueLayout", "UnitsConfig", "WarmupConfig",
    "WeightSyncConfig", "WorkflowConfig", "check", "from_dict", "load_config", "offload_idle", "one_of",
    "policy_loss_name", "rank_threads", "rollout_devices", "rollout_dtype", "to_dict", "usable_cpus",
]
