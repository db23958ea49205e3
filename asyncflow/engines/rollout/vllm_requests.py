"""Request-level bookkeeping over vLLM's step-based engine (``LLMEngine``), apart from vLLM.

`VLLMRequests` turns `GenerationRequest`s into vLLM requests (``add_request`` /
``step`` / ``abort_request``) and keeps, per request, every token that came back with its
behaviour log-prob and the policy version held when it was sampled. Keeping them here
rather than in vLLM is what lets a request be aborted with what it has, or taken out of
vLLM and re-added with prompt + tokens so far, without losing anything it produced.

It needs vLLM's outputs as deltas (`RequestOutputKind.DELTA`: each `step()` returns only
the tokens sampled in that step) and a `step()` that is one synchronous engine iteration
(in-process engine core, no async scheduling): then a token's version is the version held
during the `step()` that returned it. `VLLMRolloutEngine` builds vLLM that way.
"""
from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow.engines.rollout.base import GenerationRequest, RequestId, RequestResult, SamplingParams

__all__ = ["VLLMRequests", "continuation_seed", "filtered_log_probs_problem"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# The errors vLLM's add_request raises for one bad request (too long, out-of-vocab ids, bad
# params): those become that request's "error" result; anything else is the engine's own failure.
_REFUSALS = (ValueError, TypeError)

# (params, budget, seed) -> vLLM SamplingParams
ParamsFactory = Callable[[SamplingParams, int, int], Any]


def filtered_log_probs_problem(params: SamplingParams, allow_filtered: bool) -> str | None:
    """Why vLLM cannot give these params' log-probs as the contract defines them, or None.
    vLLM computes log-probs after top-k/top-p filtering, the contract wants them before."""
    if params.greedy or allow_filtered or (params.top_k == 0 and params.top_p >= 1.0):
        return None
    return ("vLLM returns log-probs after top-k/top-p filtering, not before as the rollout contract "
            "requires; use top_k=0 and top_p=1, or build the engine with allow_filtered_log_probs=True "
            "to accept filtered log-probs")


def continuation_seed(seed: int, done: int) -> int:
    """A fresh, deterministic seed for the rest of a row re-added to vLLM after ``done`` tokens
    (reusing the seed would replay the random draws of the row's first tokens)."""
    return (int(seed) * 1_000_003 + int(done) * 7919 + 17) % (2 ** 31 - 1)


@dataclass
class _VllmRow:
    """One request and what it has produced so far, across however many vLLM requests."""

    request: GenerationRequest
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    vllm_id: str | None = None  # its live vLLM request; None while held back for min_version

    @property
    def left(self) -> int:
        return self.request.budget - len(self.tokens)

    def result(self, reason: str, error: str | None = None) -> RequestResult:
        return RequestResult(self.request.request_id, torch.tensor(self.tokens, dtype=torch.int64),
                             torch.tensor(self.log_probs, dtype=torch.float32),
                             torch.tensor(self.versions, dtype=torch.int64), reason, error)


def _accepts_keyword(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _empty_result(request_id: RequestId, reason: str, error: str | None = None) -> RequestResult:
    return RequestResult(request_id, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32),
                         torch.empty(0, dtype=torch.int64), reason, error)


class VLLMRequests:
    """The request table of one vLLM engine. Not thread-safe (one driving thread).

    engine: vLLM's ``LLMEngine`` (or a stand-in with add_request / step / abort_request /
        has_unfinished_requests / reset_prefix_cache).
    make_params: builds the vLLM SamplingParams of a (params, budget, seed).
    current_version: the policy version of the weights held now.
    max_model_len: the model's context (prompts that leave no room are refused here, with
        the numbers; None leaves all checks to vLLM).
    salt_prompts: give each vLLM request a prefix-cache salt naming the version it was
        admitted under, so that no request reuses cached blocks computed with older weights
        (vLLM can't drop those while running requests still hold them).
    lora_request: the LoRARequest every request carries (the policy's adapter), or None.
    """

    def __init__(self, engine: Any, make_params: ParamsFactory, *, current_version: Callable[[], int],
                 max_model_len: int | None = None, allow_filtered_log_probs: bool = False,
                 salt_prompts: bool = True, lora_request: Any = None) -> None:
        self.engine = engine
        self.lora_request = lora_request
        self._make_params = make_params
        self._version = current_version
        self.max_model_len = max_model_len
        self.allow_filtered_log_probs = allow_filtered_log_probs
        self.salt_prompts = salt_prompts
        self._held: dict[RequestId, _VllmRow] = {}  # admitted to vLLM at a step once min_version is held
        self._live: dict[str, _VllmRow] = {}  # vLLM request id -> row
        self._known: dict[RequestId, _VllmRow] = {}  # held or live, by request id
        self._ready: list[RequestResult] = []  # finished outside a vLLM step: returned by the next step
        self._vllm_ids = itertools.count()
        self.counters = {"finished": 0, "aborted": 0, "unknown_aborts": 0, "errors": 0, "swaps": 0,
                         "steps": 0, "tokens": 0, "recomputed_rows": 0, "readded_rows": 0}
        # Newer vLLM preempts running requests on reset_prefix_cache(reset_running_requests=True)
        # (they are then recomputed); older vLLM can't, and a recompute swap re-adds them instead.
        self.native_recompute = _accepts_keyword(engine.reset_prefix_cache, "reset_running_requests")

    # ---- the request API -----------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if rid in self._known:
            raise ValueError(f"add_request: request id {rid!r} is already queued or running")
        problem = self._problem(request)
        if problem is not None:
            self.counters["errors"] += 1
            self._ready.append(_empty_result(rid, "error", f"request {rid!r}: {problem}"))
            return
        if request.budget == 0:  # vLLM needs max_tokens >= 1; nothing to generate
            self.counters["finished"] += 1
            self._ready.append(_empty_result(rid, "length"))
            return
        row = _VllmRow(request, [int(t) for t in request.prompt_ids.tolist()])
        self._known[rid] = row
        self._held[rid] = row

    def abort(self, request_id: RequestId) -> bool:
        row = self._known.pop(request_id, None)
        if row is None:
            self.counters["unknown_aborts"] += 1
            return False
        if row.vllm_id is None:
            del self._held[request_id]
        else:
            self.engine.abort_request([row.vllm_id])
            del self._live[row.vllm_id]
        self.counters["aborted"] += 1
        self._ready.append(row.result("abort"))
        return True

    def step(self) -> list[RequestResult]:
        self._admit()
        if self._live:
            if not self.engine.has_unfinished_requests():
                self._lost()
            else:
                outputs = self.engine.step()
                self.counters["steps"] += 1
                for out in outputs:
                    self._absorb(out)
        done, self._ready = self._ready, []
        return done

    def has_work(self) -> bool:
        return bool(self._held or self._live or self._ready)

    def new_tokens(self, since: Mapping[RequestId, int]) -> dict[RequestId, tuple[list[int], list[float]]]:
        """The tokens live requests absorbed after ``since`` of them (RequestEngine.new_tokens)."""
        out = {}
        for rid, seen in since.items():
            row = self._known.get(rid)
            if row is not None and len(row.tokens) > seen:
                out[rid] = (row.tokens[seen:], row.log_probs[seen:])
        return out

    def stats(self) -> dict:
        # running: handed to vLLM (its own queue included); waiting: held back for min_version
        return {**self.counters, "running": len(self._live), "waiting": len(self._held)}

    @property
    def live_rows(self) -> int:
        return len(self._live)

    # ---- after a weight swap -------------------------------------------------------------

    def after_swap(self, mode: str) -> None:
        """Invalidate what new weights (just loaded) made stale. ``mode`` (``SWAP_MODES``):
        keep: live requests continue on their KV cache; recompute: vLLM recomputes it.
        Either way no request admitted from now on reuses cached blocks of older weights."""
        running = len(self._live)
        self.counters["swaps"] += 1
        if mode == "recompute" and running:
            self.counters["recomputed_rows"] += running
            if self.native_recompute:
                # vLLM preempts every running request and resets the prefix cache: each is
                # prefilled again (prompt + its outputs) with the new weights, same vLLM request.
                self.engine.reset_prefix_cache(reset_running_requests=True)
            else:
                self._readd_live()
        elif not running:
            self.engine.reset_prefix_cache()
        # keep with running requests: vLLM can't reset the cache while they hold blocks; the
        # per-version salt keeps new requests off the blocks computed with older weights.

    def _readd_live(self) -> None:
        """Take every live request out of vLLM and add it again with prompt + tokens so far as
        its prompt: vLLM prefills it with the weights now held. What each row produced stays
        with the row."""
        rows = list(self._live.values())
        self.engine.abort_request([r.vllm_id for r in rows])
        self._live.clear()
        self.engine.reset_prefix_cache()  # nothing holds blocks now, so this one succeeds
        for row in rows:
            row.vllm_id = None
            self._submit(row)
        self.counters["readded_rows"] += len(rows)

    # ---- internals -----------------------------------------------------------------------

    def _problem(self, request: GenerationRequest) -> str | None:
        p = request.prompt_ids
        if not isinstance(request.params, SamplingParams):
            return f"params must be a SamplingParams, got {type(request.params).__name__}"
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            return f"prompt_ids must be a non-empty 1-D token tensor, got {shape}"
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            return f"prompt_ids must hold integer token ids, got dtype {p.dtype}"
        if int(p.min()) < 0:
            return f"prompt_ids has a negative token id ({int(p.min())})"
        if request.budget < 0:
            return f"max_new_tokens must be >= 0, got {request.budget}"
        if self.max_model_len is not None and request.budget > 0 and p.numel() >= self.max_model_len:
            return (f"prompt of {p.numel()} tokens leaves no room in the model's context of "
                    f"{self.max_model_len} tokens (max_model_len)")
        return filtered_log_probs_problem(request.params, self.allow_filtered_log_probs)

    def _admit(self) -> None:
        version = self._version()
        for rid in [rid for rid, row in self._held.items() if row.request.min_version <= version]:
            self._submit(self._held.pop(rid))

    def _submit(self, row: _VllmRow) -> None:
        """Add the row to vLLM: prompt + tokens so far, the budget left, and a fresh seed when
        it continues a row (so its draws don't repeat those of its first tokens)."""
        req = row.request
        vllm_id = f"asyncflow-{next(self._vllm_ids)}"
        prompt: dict[str, Any] = {"prompt_token_ids": row.prompt + row.tokens}
        if self.salt_prompts:
            prompt["cache_salt"] = f"asyncflow-v{self._version()}"
        seed = req.seed if not row.tokens else continuation_seed(req.seed, len(row.tokens))
        try:
            params = self._make_params(req.params, row.left, seed)
            if self.lora_request is None:
                self.engine.add_request(vllm_id, prompt, params)
            else:
                self.engine.add_request(vllm_id, prompt, params, lora_request=self.lora_request)
        except _REFUSALS as exc:
            del self._known[req.request_id]
            self._refused(row, f"vLLM refused it: {type(exc).__name__}: {exc}")
            return
        row.vllm_id = vllm_id
        self._live[vllm_id] = row

    def _refused(self, row: _VllmRow, why: str) -> None:
        message = f"request {row.request.request_id!r}: {why}"
        if row.tokens:
            # It had started (e.g. refused when re-added after a swap): an "error" result has no
            # tokens, so it ends as "abort" with its tokens and the reason, to be continued.
            self.counters["aborted"] += 1
            self._ready.append(row.result("abort", message))
        else:
            self.counters["errors"] += 1
            self._ready.append(_empty_result(row.request.request_id, "error", message))

    def _absorb(self, out: Any) -> None:
        row = self._live.get(out.request_id)
        if row is None:  # a request we aborted or re-added: its late output is stale
            return
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        lps = comp.logprobs if comp.logprobs is not None else []
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} log-prob entries for {len(ids)} new tokens "
                               f"(request {row.request.request_id!r}, vLLM id {out.request_id})")
        version = self._version()
        for t, d in zip(ids, lps):
            row.tokens.append(t)
            row.log_probs.append(float(d[t].logprob))
            row.versions.append(version)
        self.counters["tokens"] += len(ids)
        if out.finished:
            del self._live[out.request_id]
            del self._known[row.request.request_id]
            reason = _FINISH.get(str(comp.finish_reason))
            if reason is None:  # not one of ours (e.g. "error"): say so, keep what it produced
                self._refused(row, f"vLLM finished it with reason {comp.finish_reason!r}")
                return
            self.counters["aborted" if reason == "abort" else "finished"] += 1
            self._ready.append(row.result(reason))

    def _lost(self) -> None:
        """vLLM holds none of our live requests (it dropped them): end them rather than wait forever."""
        for vllm_id, row in list(self._live.items()):
            del self._live[vllm_id]
            del self._known[row.request.request_id]
            self._refused(row, f"vLLM no longer holds it (vLLM id {vllm_id})")
