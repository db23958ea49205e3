"""Training engines: the `TrainEngine` interface, the FSDP2 engine and the MindSpeed adapter.

Importing this package is cheap (no transformers, no mindspeed): those load lazily.
"""

from asyncflow.engines.train.base import LossFn, LossNorm, NonFiniteUpdateError, OptimConfig, TrainEngine
from asyncflow.engines.train.fsdp import FSDPEngine
from asyncflow.engines.train.mindspeed import MindSpeedEngine
from asyncflow.engines.train.schedule import lr_at
from asyncflow.engines.train.value_model import ValueModel

__all__ = ["FSDPEngine", "LossFn", "LossNorm", "MindSpeedEngine", "NonFiniteUpdateError", "OptimConfig",
           "TrainEngine", "ValueModel", "lr_at"]
