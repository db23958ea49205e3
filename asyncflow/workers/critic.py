"""The critic (PPO): a value head on the policy's backbone; values in, a value-loss step out."""
from __future__ import annotations

from typing import Any

import torch

from ..single_controller import Dispatch, Worker, register
from .actor import _share
from .actor_loss import AlgoSettings, compute_advantages
from .common import (EngineCheckpoints, EngineOffload, import_modules, model_factory, rows,
                     per_token_column, set_threads, train_engine_class)


class CriticWorker(EngineCheckpoints, EngineOffload, Worker):
    def __init__(self, model_path: str, optim: dict, algorithm: dict, threads: int = 0,
                 attn_implementation: str | None = None, imports: list[str] = (),
                 train_engine: str = "fsdp", value_loss: str = "clipped", value_clip: float = 0.2,
                 offload: bool = False):
        from ..engines.train import OptimConfig

        set_threads(threads)
        import_modules(imports)
        self.algo = AlgoSettings.from_dict(algorithm)
        self.value_loss = value_loss
        self.value_clip = value_clip
        self.engine = train_engine_class(train_engine)(model_factory(model_path, attn_implementation), OptimConfig(**optim),
                                 process_group=self.process_group, platform=self.platform, value_head=True)
        self.start_idle(offload)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def compute_values(self, meta: Any) -> None:
        per_token_column(self, meta, "values", self.engine.compute_values)

    @register(Dispatch.ONE_TO_ALL)
    def update(self, meta: Any) -> dict:
        from ..algorithms import VALUE_LOSSES
        from ..algorithms.aggregate import aggregate

        data = self.tq.get_data(meta, ["prompt_ids", "response_ids", "scores", "values"])
        prompts, responses = rows(data["prompt_ids"]), rows(data["response_ids"])
        old_values = [v.float() for v in rows(data["values"])]
        groups = torch.tensor(meta.groups if meta.groups else range(len(meta)), dtype=torch.long)
        _, returns = compute_advantages(self.algo, data["scores"].float(), groups, [len(r) for r in responses],
                                        values=old_values)
        idx = _share(len(meta), self.dp_rank, self.dp_size)
        loss_name, clip = self.value_loss, self.value_clip

        def loss_fn(values, entropy, mask, fields, norm):
            per_token, diag = VALUE_LOSSES.get(loss_name)(values, fields["old_values"], fields["returns"], mask,
                                                          clip=clip)
            loss = aggregate(per_token, mask, "token-mean", num_tokens=norm.num_tokens, num_seqs=norm.num_seqs)
            m = mask.float()
            return loss, {f"critic/{k}": float((v.float() * m).sum() / m.sum().clamp(min=1)) for k, v in diag.items()}

        fields = {"old_values": [old_values[i] for i in idx], "returns": [returns[i] for i in idx]}
        m = self.engine.train_step([prompts[i] for i in idx], [responses[i] for i in idx], fields, loss_fn)
        return {f"critic/{k}" if "/" not in k else k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
