"""The actor: trains the policy (and recomputes proximal log-probs); publishes its weights."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..single_controller import Dispatch, Worker, register
from ..workflow import weight_sync as ws
from .actor_loss import AlgoSettings, compute_advantages, policy_loss_fn, sft_loss_fn
from .common import (EngineCheckpoints, EngineOffload, import_modules, model_factory, per_token_column,
                     rows, set_threads, train_engine_class)


def _share(n: int, dp_rank: int, dp_size: int) -> range:
    q, r = divmod(n, dp_size)
    start = dp_rank * q + min(dp_rank, r)
    return range(start, start + q + (1 if dp_rank < r else 0))


class ActorWorker(EngineCheckpoints, EngineOffload, Worker):
    def __init__(self, model_path: str, optim: dict, algorithm: dict, temperature: float = 1.0,
                 threads: int = 0, attn_implementation: str | None = None, imports: list[str] = (),
                 train_engine: str = "fsdp", seed: int = 0,
                 sync_timeout_s: float = 300.0, offload: bool = False):
        from ..engines.train import OptimConfig

        set_threads(threads)
        import_modules(imports)
        torch.manual_seed(seed + self.rank)
        self.model_path = model_path
        self.temperature = temperature
        self.algo = AlgoSettings.from_dict(algorithm)
        self.engine = train_engine_class(train_engine)(model_factory(model_path, attn_implementation), OptimConfig(**optim),
                                 process_group=self.process_group, platform=self.platform)
        self.sender: ws.WeightSender | None = None
        self.sync_timeout_s = sync_timeout_s
        self.published = 0
        self.start_idle(offload)  # colocated placement: free the device while other roles run

    # ---- optimisation ----------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def reset_optimizer(self, optim: dict) -> None:
        from ..engines.train import OptimConfig
        self.engine.reset_optimizer(OptimConfig(**optim))

    @register(Dispatch.ONE_TO_ALL)
    def sft_step(self, prompts: list[list[int]], targets: list[list[int]]) -> dict:
        """One supervised step on the global batch (each rank trains on its share)."""
        mine = _share(len(prompts), self.dp_rank, self.dp_size)
        p = [torch.tensor(prompts[i], dtype=torch.long) for i in mine]
        t = [torch.tensor(targets[i], dtype=torch.long) for i in mine]
        return self.engine.train_step(p, t, {}, sft_loss_fn, temperature=1.0)

    @register(Dispatch.ONE_TO_ALL)
    def compute_log_probs(self, meta: Any) -> Any:
        """Proximal log-probs (the weights the next update starts from) -> ``old_log_probs``."""
        per_token_column(self, meta, "old_log_probs", lambda p, r: self.engine.compute_log_probs(
            p, r, temperature=self.temperature)[0])

    @register(Dispatch.ONE_TO_ALL)
    def update(self, meta: Any, step: int) -> dict:
        """One policy update on the step's rows: advantages over the whole batch (group
        baselines), the loss on this rank's share."""
        have = set(meta.columns)
        cols = [c for c in ("prompt_ids", "response_ids", "scores", "behav_log_probs", "old_log_probs",
                            "ref_log_probs", "values", "gen_version") if c in have]
        data = self.tq.get_data(meta, cols)
        prompts, responses = rows(data["prompt_ids"]), rows(data["response_ids"])
        lengths = [len(r) for r in responses]
        scores = data["scores"].float()
        groups = torch.tensor(meta.groups if meta.groups else range(len(meta)), dtype=torch.long)
        per_token = {c: [x.float() for x in rows(data[c])] for c in
                     ("behav_log_probs", "old_log_probs", "ref_log_probs", "values") if c in have}
        adv, _ = compute_advantages(self.algo, scores, groups, lengths, values=per_token.get("values"),
                                    log_probs=per_token.get("old_log_probs", per_token.get("behav_log_probs")),
                                    ref_log_probs=per_token.get("ref_log_probs"))
        mine = _share(len(meta), self.dp_rank, self.dp_size)
        fields = {"advantages": [adv[i] for i in mine]}
        for c in ("behav_log_probs", "old_log_probs", "ref_log_probs"):
            if c in per_token:
                fields[c] = [per_token[c][i] for i in mine]
        metrics = self.engine.train_step([prompts[i] for i in mine], [responses[i] for i in mine], fields,
                                         policy_loss_fn(self.algo), temperature=self.temperature,
                                         with_entropy=True)
        out = {(k if "/" in k else f"actor/{k}"): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        out.update({"reward/mean": float(scores.mean()), "reward/max": float(scores.max()),
                    "response_length/mean": sum(lengths) / max(len(lengths), 1),
                    "rows": float(len(meta)), "tokens": float(sum(lengths) + sum(len(p) for p in prompts)),
                    "response_tokens": float(sum(lengths))})
        if "gen_version" in data.keys():
            stale = step - data["gen_version"].long()
            out["async/staleness_mean"] = float(stale.float().mean())
            out["async/staleness_max"] = float(stale.max())
        return out

    # ---- weights out -----------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, instances: list[list[int]]) -> None:
        """The first actor rank makes one group per rollout instance (itself + that instance)."""
        if self.group_rank != 0:
            return
        groups = {}
        for k, ranks in enumerate(instances):
            members = sorted({self.rank, *ranks})
            groups[k] = None if members == [self.rank] else self.group_of(members)
        self.sender = ws.WeightSender(self.rank, groups, self.sync_timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self, version: int) -> dict:
        """Gather full weights to host (all actor ranks), pack, start the background sends."""
        start = time.monotonic()
        sd = self.engine.full_state_dict()
        if self.group_rank != 0:
            return {}
        if self.sender is None:
            raise RuntimeError(f"actor rank {self.rank}: publish_weights before init_weight_sync")
        self.published += 1
        packed = ws.pack_weights(sd, version, self.published)
        ws.LOCAL_MAILBOX.put(packed)
        self.sender.publish(packed)
        return {"bytes": packed.header.nbytes, "publish_s": time.monotonic() - start}

    @register(Dispatch.ONE_TO_ALL)
    def wait_weights_sent(self) -> None:
        if self.sender is not None:
            self.sender.wait()

    # ---- export ----------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        from ..models.loading import load_tokenizer
        self.engine.export_hf(path, tokenizer=load_tokenizer(self.model_path))

    @register(Dispatch.ONE_TO_ALL)
    def step_count(self) -> int:
        return int(self.engine.step)
