"""The reference policy: the frozen policy RL starts from; log-probs for the KL term."""
from __future__ import annotations

from typing import Any

from .. import column_names as col
from ..cpu_account import charged
from ..engines.train import OptimConfig
from ..models.loading import load_causal_lm
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta
from ..workflow.stages import StageIO
from .common import EngineOffload, per_token_column, policy_model, resolved_of, setup_rank, train_engine_class


class ReferenceWorker(EngineOffload, Worker):
    def __init__(self, cfg: dict):
        run = resolved_of(cfg, self.platform.name)
        c = run.config
        setup_rank(run)
        self.temperature = c.rollout.temperature
        # A training engine that never steps (its optimizer is never used): the same sharding
        # and log-prob code as the actor.
        self.engine = train_engine_class(c.model.train_engine)(policy_model(c), OptimConfig(lr=1.0),
                                                               process_group=self.process_group, platform=self.platform)
        self.start_idle(run.derived.offload_idle)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def load_reference(self, path: str) -> None:
        """Take the weights of an HF directory (the warmed-up policy's export) as the reference:
        the trainer calls this on every role that defines it once warm-up is done."""
        self.engine.load_model_state(load_causal_lm(path).state_dict())

    @register(Dispatch.ONE_TO_ALL)
    @charged("ref_log_prob")
    def compute_log_probs(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> None:
        """[prompt, response] -> the reference's per-token log-probs."""
        per_token_column(self, meta, StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.REF_LOG_PROBS]),
                         lambda p, r: self.engine.compute_log_probs(p, r, temperature=self.temperature)[0])
