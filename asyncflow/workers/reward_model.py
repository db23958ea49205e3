"""The reward role served by the training engine: a reward model (a sequence-classification
checkpoint with one label) scores prompt + response at the response's last token."""
from __future__ import annotations

from typing import Any

import torch

from ..single_controller import Dispatch, Worker, register
from .common import EngineOffload, import_modules, set_threads, share_column, train_engine_class


def score_sequences(engine: Any, prompts: list[torch.Tensor], responses: list[torch.Tensor],
                    pad_id: int) -> list[float]:
    """The model's score of each whole sequence. The engine gives the value of the state before
    each response token, so one placeholder token is appended: the value before it is the
    value at the response's last token (what a sequence classifier pools)."""
    padded = [torch.cat([r.long(), r.new_full((1,), pad_id).long()]) for r in responses]
    return [float(v[-1]) for v in engine.compute_values(prompts, padded)]


class RewardModelWorker(EngineOffload, Worker):
    def __init__(self, model_path: str, reward_model_path: str, threads: int = 0,
                 attn_implementation: str | None = None, imports: list[str] = (), train_engine: str = "fsdp",
                 offload: bool = False):
        from ..engines.train import OptimConfig
        from ..models.loading import load_reward_model, load_tokenizer

        set_threads(threads)
        import_modules(imports)
        self.pad_id = int(load_tokenizer(model_path).pad_token_id)
        # A training engine that never steps: the same sharding and forward code as the critic.
        self.engine = train_engine_class(train_engine)(
            lambda: load_reward_model(reward_model_path, attn_implementation=attn_implementation),
            OptimConfig(lr=1.0), process_group=self.process_group, platform=self.platform, value_head=True)
        self.start_idle(offload)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def compute(self, meta: Any) -> None:
        share_column(self, meta, "scores", lambda p, r: torch.tensor(
            score_sequences(self.engine, p, r, self.pad_id), dtype=torch.float32))

    @register(Dispatch.ONE_TO_ALL)
    def stats(self) -> dict:
        return {"reward/errors": 0, "reward/timeouts": 0}
