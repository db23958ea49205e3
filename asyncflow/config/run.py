"""The whole run's config: the tree of sections that a recipe yaml and ``key=value`` overrides fill."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The algorithm section lives below both this package and asyncflow.algorithms, whose functions
# take it as their cfg: config imports the algorithms (to check a run's names), never the reverse.
from ..algorithm_config import AlgorithmConfig

# The transfer_queue section is the single controller's own dataclass: it starts the units.
from ..single_controller.tq_units import TransferQueueLayout
from .sections import (
    AgentConfig,
    DataConfig,
    FaultConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    WarmupConfig,
    WeightSyncConfig,
    WorkflowConfig,
)


@dataclass
class RunConfig:
    recipe: str = "grpo"
    # Modules every worker imports first: where your own @register_reward / registry entries live.
    imports: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # RL: the cosine (min_lr_ratio < 1) spans trainer.steps unless total_steps is set
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=20, min_lr_ratio=1.0))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20,
                                                                          min_lr_ratio=1.0))
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transfer_queue: TransferQueueLayout = field(default_factory=TransferQueueLayout)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    # Free-form keys of a recipe of your own (read them in its build(cfg) or its workers).
    recipe_options: dict[str, Any] = field(default_factory=dict)
