"""A rollout instance: generates responses with the weights it holds, swapping in new ones
between generations (or, with partial rollout, in the middle of one)."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..single_controller import Dispatch, Worker, register
from ..workflow import weight_sync as ws
from .common import EngineOffload, import_modules, rows, set_threads


def continuation_seed(seed: int, done: int) -> int:
    """A fresh, deterministic seed for the rest of a row interrupted after ``done`` tokens."""
    return (seed * 1_000_003 + done * 7919 + 17) % (2 ** 31 - 1)


class RolloutWorker(EngineOffload, Worker):
    def __init__(self, model_path: str, sampling: dict, engine: str = "builtin", threads: int = 0,
                 partial_rollout: bool = False, attn_implementation: str | None = None,
                 sync_timeout_s: float = 300.0, gpu_memory_utilization: float = 0.5,
                 imports: list[str] = (), offload: bool = False):
        from ..engines.rollout import SamplingParams
        from ..models.loading import load_tokenizer

        set_threads(threads)
        import_modules(imports)
        self.tokenizer = load_tokenizer(model_path)
        eos = [self.tokenizer.eos_token_id]
        if engine == "builtin":
            from ..engines.rollout.builtin import BuiltinRolloutEngine
            from ..models.loading import load_causal_lm
            model = load_causal_lm(model_path, attn_implementation=attn_implementation, device=str(self.device))
            self.engine = BuiltinRolloutEngine(model, eos_token_ids=eos, pad_token_id=self.tokenizer.pad_token_id,
                                               device=self.device)
        elif engine == "vllm":
            from ..engines.rollout.vllm import VLLMRolloutEngine
            self.engine = VLLMRolloutEngine(model_path, gpu_memory_utilization=gpu_memory_utilization)
        else:
            raise ValueError(f"rollout worker rank {self.rank}: unknown engine {engine!r} (builtin | vllm)")
        self.engine.version = 0
        self._eval_runners: dict[tuple, Any] = {}  # (reward, timeout, on_error) -> RewardRunner: one thread each
        self.params = SamplingParams(**sampling)
        self.partial = partial_rollout
        self.receiver: ws.WeightReceiver | None = None
        self.local = False  # this instance shares a process with the actor's first rank
        self.sync_timeout_s = sync_timeout_s
        self.swaps = 0
        self.aborts = 0
        self.seq = 0  # publish counter of the weights held
        self.start_idle(offload)  # colocated placement: free the device while other roles run

    # ---- colocation --------------------------------------------------------------------------
    def _free_engine(self) -> None:
        """The engine's generation memory (the builtin engine's weights to host and cached blocks
        back on an accelerator; vLLM's sleep: KV cache dropped, weights to host). Weights are
        kept: load_weights still takes new ones meanwhile."""
        self.engine.release_memory()

    def _restore_engine(self) -> None:
        self.engine.resume_memory()

    # ---- weights in --------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, src_rank: int) -> None:
        members = sorted({src_rank, *self.layout.ranks})
        if members == [self.rank]:
            self.local = True
        else:
            self.receiver = ws.WeightReceiver(src_rank, ws.new_sync_group(members, self.sync_timeout_s),
                                              self.sync_timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> None:
        """Start receiving ``version`` in the background (the actor has published it)."""
        if self.receiver is not None:
            self.receiver.start(version)

    def _staged(self) -> ws.PackedWeights | None:
        if self.local:
            packed = ws.LOCAL_MAILBOX.get()
            if packed is None or packed.header.seq <= self.seq:
                return None
            return packed
        return self.receiver.take() if self.receiver is not None and self.receiver.ready() else None

    def _newer_staged(self) -> bool:
        if self.local:
            packed = ws.LOCAL_MAILBOX.get()
            return packed is not None and packed.header.seq > self.seq
        return self.receiver is not None and self.receiver.ready()

    def _swap(self, min_version: int) -> None:
        """Take the newest staged weights; wait for them if the held ones are too old."""
        packed = self._staged()
        if packed is None and self.engine.version < min_version:
            if self.receiver is None:
                raise RuntimeError(f"rollout rank {self.rank}: needs policy version {min_version}, holds "
                                   f"{self.engine.version}, and no weights were published to it")
            self.receiver.join()
            packed = self.receiver.take()
        self._load(packed)
        if self.engine.version < min_version:
            raise RuntimeError(f"rollout rank {self.rank}: holds policy version {self.engine.version} after "
                               f"the swap, but this batch needs {min_version}")

    def _take_latest(self) -> None:
        """Wait for a receive in flight, then hold the newest weights published to this instance."""
        if self.receiver is not None and self.receiver.pending:
            self.receiver.join()
        self._load(self._staged())

    def _load(self, packed: ws.PackedWeights | None) -> None:
        if packed is not None:
            self.engine.load_weights(packed.state_dict(), packed.header.version)
            self.seq = packed.header.seq
            self.swaps += 1

    @register(Dispatch.ONE_TO_ALL)
    def version(self) -> int:
        return int(self.engine.version)

    # ---- generation --------------------------------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def generate(self, data: Any, min_version: int) -> dict:
        self._swap(min_version)
        prompts = rows(data["prompt_ids"])
        seeds = [int(s) for s in data["seed"].tolist()]
        # a per-row budget column (rollout.length_profile) replaces the sampling default
        budgets = [int(b) for b in data["max_new_tokens"].tolist()] if "max_new_tokens" in data.keys() else None
        return self._generate(prompts, seeds, budgets)

    def _generate(self, prompts: list[torch.Tensor], seeds: list[int], budgets: list[int] | None = None) -> dict:
        n = len(prompts)
        budget = list(budgets) if budgets is not None else [self.params.max_new_tokens] * n
        out_ids: list[list[torch.Tensor]] = [[] for _ in range(n)]
        out_lp: list[list[torch.Tensor]] = [[] for _ in range(n)]
        out_ver: list[list[int]] = [[] for _ in range(n)]
        todo = list(range(n))
        cur_prompts, cur_seeds = list(prompts), list(seeds)
        while todo:
            abort = self._newer_staged if self.partial else None
            gen = self.engine.generate([cur_prompts[i] for i in todo], self.params,
                                       seeds=[cur_seeds[i] for i in todo],
                                       max_new_tokens=[budget[i] for i in todo], should_abort=abort)
            version = self.engine.version
            again = []
            for j, i in enumerate(todo):
                ids, lp = gen.response_ids[j], gen.log_probs[j]
                out_ids[i].append(ids)
                out_lp[i].append(lp.float())
                out_ver[i].extend([version] * len(ids))
                budget[i] -= len(ids)
                if gen.finish_reasons[j] == "abort" and budget[i] > 0:
                    again.append(i)
                    cur_prompts[i] = torch.cat([cur_prompts[i], ids.to(cur_prompts[i].dtype)])
                    cur_seeds[i] = continuation_seed(seeds[i], len(out_ver[i]))
            if again:  # partial rollout: the rest of these rows continues on the new weights
                self.aborts += len(again)
                self._swap(self.engine.version)
            todo = again
        responses = [torch.cat(x) if x else torch.zeros(0, dtype=torch.long) for x in out_ids]
        return {
            "response_ids": responses,
            "behav_log_probs": [torch.cat(x) if x else torch.zeros(0) for x in out_lp],
            "token_versions": [torch.tensor(v, dtype=torch.long) for v in out_ver],
            "gen_version": torch.tensor([min(v) if v else self.engine.version for v in out_ver], dtype=torch.long),
        }

    @register(Dispatch.RANK_ZERO)
    def evaluate(self, prompts: list[list[int]], answers: list[str], reward: str = "number",
                 max_new_tokens: int = 8, samples: int = 4, timeout_s: float = 10.0,
                 on_error: str = "zero") -> dict:
        """Greedy accuracy on held-out prompts with the weights held now. The reward runs under
        the same per-call timeout and error policy as in training."""
        from ..engines.rollout import SamplingParams
        from ..rewards.runner import RewardRunner

        self._take_latest()
        start = time.monotonic()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        gen = self.engine.generate([torch.tensor(p, dtype=torch.long) for p in prompts], params,
                                   seeds=list(range(len(prompts))))
        texts = self.tokenizer.batch_decode([r.tolist() for r in gen.response_ids], skip_special_tokens=True)
        key = (reward, timeout_s, on_error)
        if key not in self._eval_runners:
            self._eval_runners[key] = RewardRunner(reward, timeout_s=timeout_s, on_error=on_error)
        scores, stats = self._eval_runners[key].score(texts, answers)
        shown = [{"prompt": self.tokenizer.decode(prompts[i]), "response": texts[i], "answer": answers[i]}
                 for i in range(min(samples, len(prompts)))]
        return {"accuracy": sum(scores) / max(len(scores), 1), "version": int(self.engine.version),
                "eval_s": time.monotonic() - start, "examples": shown,
                "reward_errors": stats["errors"], "reward_timeouts": stats["timeouts"]}

    @register(Dispatch.ONE_TO_ALL)
    def stats(self) -> dict:
        return {"swaps": self.swaps, "aborts": self.aborts, "version": int(self.engine.version)}
