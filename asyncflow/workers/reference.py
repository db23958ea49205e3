"""The reference policy: frozen initial weights; log-probs for the KL term."""
from __future__ import annotations

from typing import Any

from ..single_controller import Dispatch, Worker, register
from .common import EngineOffload, import_modules, model_factory, per_token_column, set_threads, train_engine_class


class ReferenceWorker(EngineOffload, Worker):
    def __init__(self, model_path: str, temperature: float = 1.0, threads: int = 0,
                 attn_implementation: str | None = None, imports: list[str] = (),
                 train_engine: str = "fsdp", offload: bool = False):
        from ..engines.train import OptimConfig

        set_threads(threads)
        import_modules(imports)
        self.temperature = temperature
        # A training engine that never steps (its optimizer is never used): the same sharding
        # and log-prob code as the actor.
        self.engine = train_engine_class(train_engine)(model_factory(model_path, attn_implementation), OptimConfig(lr=1.0),
                                 process_group=self.process_group, platform=self.platform)
        self.start_idle(offload)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> None:
        """Take the weights of an HF directory (the warmed-up policy's export) as the reference."""
        from ..models.loading import load_causal_lm
        self.engine.load_model_state(load_causal_lm(path).state_dict())

    @register(Dispatch.ONE_TO_ALL)
    def compute_log_probs(self, meta: Any) -> None:
        per_token_column(self, meta, "ref_log_probs", lambda p, r: self.engine.compute_log_probs(
            p, r, temperature=self.temperature)[0])
