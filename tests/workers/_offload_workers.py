"""Role workers for the colocated offload test: the real actor and rollout workers, plus a
way for the training role to look at the rollout workers sharing its process while it runs
(calling a rollout method would switch the rank back to the rollout role)."""
from __future__ import annotations

import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.single_controller import Dispatch, register
from asyncflow.workers.actor import ActorWorker
from asyncflow.workers.rollout import RolloutWorker

ROLLOUTS: list[RolloutWorker] = []  # the rollout workers built in this process


class ProbedRollout(RolloutWorker):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        ROLLOUTS.append(self)

    @register(Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.engine.model.parameters()))


class ProbingActor(ActorWorker):
    @register(Dispatch.ONE_TO_ALL)
    def look_at_rollouts(self) -> list[dict]:
        """What each rollout worker of this process holds while this training role runs."""
        seen = []
        for worker in ROLLOUTS:
            try:  # on the service thread: it steps the engine whenever the engine has work
                worker.service.call(lambda e: e.generate([torch.tensor([3, 4, 5])], SamplingParams(max_new_tokens=1),
                                                         seeds=[0]), 30.0, "probe")
                refused = False
            except RuntimeError:  # released: generate asks for resume_memory() first
                refused = True
            seen.append({"role": worker.role, "refused": refused, **worker.engine.memory_held()})
        return seen

    @register(Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> float:
        state = self.engine.full_state_dict()
        return float(sum(v.double().sum() for k, v in state.items() if k != "lm_head.weight"))
