"""vLLM adapter: the RolloutEngine interface over `vllm.LLM` (GPU; NPU via vllm-ascend).

vllm is imported when an engine is built, never at module import. Notes on semantics:
- log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, i.e. after
  temperature - what our contract asks for - but vLLM also applies top-k/top-p before
  computing them. So with top-k/top-p on, its log-probs are of the filtered,
  renormalised distribution; generate() refuses that unless the engine was built with
  `allow_filtered_log_probs=True`. (Greedy: plain logits, as the contract says.)
- seeding: one `seed` per request, which vLLM turns into a per-request generator.
- abort: with `should_abort`, requests are driven step by step through
  `llm.llm_engine` (add_request / step / abort_request), so partial rows come back.
- weights: `collective_rpc` into every worker (see vllm_worker.py), then the prefix
  cache is reset so no KV computed with the old weights is reused.
Needs a vLLM with V1 `logprobs_mode`, `worker_extension_cls` and sleep mode (>= 0.10.2).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncflow.engines.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, check_generate_args

__all__ = ["VLLMRolloutEngine"]

_EXTENSION = "asyncflow.engines.rollout.vllm_worker.WeightLoaderExtension"


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("VLLMRolloutEngine needs vLLM: pip install asyncflow[gpu] "
                          "(on Ascend NPUs: pip install asyncflow[npu])") from exc
    return vllm


def _hf_weight_names(model_path: str) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """The HF state_dict names and shapes of the checkpoint's model, and its tied-name groups,
    from a model built on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    by_obj: dict[int, list[str]] = {}
    for name, p in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        if name in shapes:
            by_obj.setdefault(id(p), []).append(name)
    return shapes, list(by_obj.values())


class VLLMRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool = True, dtype: str = "bfloat16", seed: int = 0,
                 allow_filtered_log_probs: bool = False, **llm_kwargs: Any) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        self.enable_sleep_mode = enable_sleep_mode
        self.allow_filtered_log_probs = allow_filtered_log_probs
        self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                            dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                            worker_extension_cls=_EXTENSION, **llm_kwargs)
        self._shapes, self._groups = _hf_weight_names(model_path)
        self.version = 0
        self._weights_asleep = self._kv_asleep = False
        self._req_ids = itertools.count()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, *, seeds: list[int],
                 max_new_tokens: list[int] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> GenerationOutput:
        budgets = check_generate_args(prompts, params, seeds, max_new_tokens)
        if self._weights_asleep or self._kv_asleep:
            raise RuntimeError("VLLMRolloutEngine.generate after release_memory(): call resume_memory() first")
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0) and not self.allow_filtered_log_probs:
            raise ValueError("vLLM returns log-probs after top-k/top-p filtering, not before as the rollout "
                             "contract requires; use top_k=0 and top_p=1, or build the engine with "
                             "allow_filtered_log_probs=True to accept filtered log-probs")
        n = len(prompts)
        responses = [torch.empty(0, dtype=torch.int64) for _ in range(n)]
        log_probs = [torch.empty(0, dtype=torch.float32) for _ in range(n)]
        reasons = ["length"] * n
        rows = [i for i in range(n) if budgets[i] > 0]  # vLLM needs max_tokens >= 1
        inputs = [{"prompt_token_ids": prompts[i].tolist()} for i in rows]
        sps = [self._sampling_params(params, budgets[i], seeds[i]) for i in rows]
        if not rows:
            return GenerationOutput(responses, log_probs, reasons)
        if should_abort is None:
            outs = self.llm.generate(inputs, sampling_params=sps, use_tqdm=False)
            results = [o.outputs[0] for o in outs]
        else:
            results = self._generate_abortable(inputs, sps, should_abort)
        for i, c in zip(rows, results):
            if c is None:  # aborted before producing anything
                reasons[i] = "abort"
                continue
            ids = list(c.token_ids)
            responses[i] = torch.tensor(ids, dtype=torch.int64)
            lps = c.logprobs or []
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} log-prob entries for {len(ids)} tokens (row {i})")
            log_probs[i] = torch.tensor([d[t].logprob for d, t in zip(lps, ids)], dtype=torch.float32)
            reasons[i] = {"stop": "stop", "length": "length"}.get(c.finish_reason, "abort")
        return GenerationOutput(responses, log_probs, reasons)

    def _sampling_params(self, params: SamplingParams, budget: int, seed: int):
        from vllm.sampling_params import RequestOutputKind
        return self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=budget, seed=int(seed), logprobs=0, stop_token_ids=list(params.stop_token_ids),
            detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)

    def _generate_abortable(self, inputs: list[dict], sps: list, should_abort: Callable[[], bool]) -> list:
        """Drive the engine step by step, polling should_abort between steps; keep each request's
        latest cumulative output so an abort can return the partial rows."""
        engine = self.llm.llm_engine
        ids = [f"asyncflow-{next(self._req_ids)}" for _ in inputs]
        for rid, inp, sp in zip(ids, inputs, sps):
            engine.add_request(rid, inp, sp)
        latest: dict[str, Any] = {}
        pending = set(ids)
        while pending:
            if should_abort():
                engine.abort_request(list(pending))
                break
            for out in engine.step():
                latest[out.request_id] = out
                if out.finished:
                    pending.discard(out.request_id)
        results = []
        for rid in ids:
            out = latest.get(rid)
            c = out.outputs[0] if out is not None else None
            if c is not None and rid in pending:
                c.finish_reason = "abort"  # cut short by us, whatever vLLM's last snapshot said
            results.append(c)
        return results

    # ---- weights and memory -------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        unknown = sorted(k for k in state_dict if k not in self._shapes)
        if unknown:
            raise KeyError(f"load_weights: unknown weight names {unknown[:5]} (expected HF state_dict names)")
        for k, v in state_dict.items():
            if tuple(v.shape) != self._shapes[k]:
                raise ValueError(f"load_weights: shape mismatch for {k!r}: got {tuple(v.shape)}, "
                                 f"the model has {self._shapes[k]}")
        missing = sorted(g[0] for g in self._groups if not any(n in state_dict for n in g))
        if missing:
            raise KeyError(f"load_weights: missing weights {missing[:5]} ({len(missing)} in all)")
        if self._weights_asleep:  # wake the weights only; the KV cache stays released
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        named = [(k, v.detach().contiguous()) for k, v in state_dict.items()]
        self.llm.collective_rpc("asyncflow_load_weights", args=(named,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.version = int(version)

    def release_memory(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("release_memory needs the engine built with enable_sleep_mode=True")
        if not (self._weights_asleep or self._kv_asleep):
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
            self._weights_asleep = self._kv_asleep = True

    def resume_memory(self) -> None:
        if self._weights_asleep and self._kv_asleep:
            self.llm.wake_up()
        elif self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
        self._weights_asleep = self._kv_asleep = False
