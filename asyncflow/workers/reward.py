"""The reward role: decodes responses and scores them with a rule from the registry."""
from __future__ import annotations

from typing import Any

import torch

from ..single_controller import Dispatch, Worker, register
from .common import import_modules, rows, values


class RewardWorker(Worker):
    needs_device = False  # a rule over decoded text: the roles beside it stay loaded

    def __init__(self, model_path: str, reward: str = "number", timeout_s: float = 10.0, on_error: str = "zero",
                 imports: list[str] = ()):
        from ..models.loading import load_tokenizer
        from ..rewards.runner import RewardRunner

        import_modules(imports)
        self.tokenizer = load_tokenizer(model_path)
        self.runner = RewardRunner(reward, timeout_s=timeout_s, on_error=on_error)
        self.errors = 0
        self.timeouts = 0

    @register(Dispatch.DP_COMPUTE)
    def compute(self, data: Any) -> dict:
        texts = self.tokenizer.batch_decode([r.tolist() for r in rows(data["response_ids"])],
                                            skip_special_tokens=True)
        answers = [str(a) for a in values(data["answer"])]
        scores, stats = self.runner.score(texts, answers, [{} for _ in texts])
        self.errors += int(stats.get("errors", 0))
        self.timeouts += int(stats.get("timeouts", 0))
        return {"scores": torch.tensor(scores, dtype=torch.float32)}

    @register(Dispatch.ONE_TO_ALL)
    def stats(self) -> dict:
        return {"reward/errors": self.errors, "reward/timeouts": self.timeouts}
