"""The reward role served by the training engine: a reward model (a sequence-classification
checkpoint with one label) scores prompt + response at the response's last token."""
from __future__ import annotations

from typing import Any

import torch

from .. import column_names as col
from ..engines.train import OptimConfig
from ..models.loading import load_reward_model, load_tokenizer
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta
from ..workflow.stages import StageIO
from .common import EngineOffload, resolved_of, setup_rank, share_column, train_engine_class


def score_sequences(engine: Any, prompts: list[torch.Tensor], responses: list[torch.Tensor],
                    pad_id: int) -> list[float]:
    """The model's score of each whole sequence. The engine gives the value of the state before
    each response token, so one placeholder token is appended: the value before it is the
    value at the response's last token (what a sequence classifier pools)."""
    padded = [torch.cat([r.long(), r.new_full((1,), pad_id).long()]) for r in responses]
    return [float(v[-1]) for v in engine.compute_values(prompts, padded)]


class RewardModelWorker(EngineOffload, Worker):
    def __init__(self, cfg: dict):
        run = resolved_of(cfg, self.platform.name)
        c = run.config
        setup_rank(run)
        if not c.reward.model_path:
            raise ValueError("RewardModelWorker: reward.model_path names no reward model checkpoint")
        self.pad_id = int(load_tokenizer(c.model.path).pad_token_id)
        path, attn = c.reward.model_path, c.model.attn_implementation or None
        # A training engine that never steps: the same sharding and forward code as the critic.
        self.engine = train_engine_class(c.model.train_engine)(
            lambda: load_reward_model(path, attn_implementation=attn),
            OptimConfig(lr=1.0), process_group=self.process_group, platform=self.platform, value_head=True)
        self.start_idle(run.derived.offload_idle)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def compute(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> None:
        """[prompt, response] -> the reward model's score of each whole sequence."""
        share_column(self, meta, StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.SCORES]),
                     lambda p, r: torch.tensor(score_sequences(self.engine, p, r, self.pad_id), dtype=torch.float32))
