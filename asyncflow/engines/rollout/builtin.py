"""The built-in rollout engine: continuous batching of a Hugging Face causal LM with a KV cache.

Made for CPU (AsyncFlow's default engine on a laptop) and correct on any device. It is
driven request by request (``RequestEngine``): each ``step()`` decodes one token for
every running row, admits waiting requests into the slots that finished rows left
(their prefill runs in the same step, a long prompt in chunks over several steps), and
returns the rows that finished. So the compute follows the rows that are generating,
and a row never waits for the longest row of its batch. ``generate()`` (the batch API)
submits its prompts and steps until they are all done.

This module is the scheduler: the queue, admission into slots, aborts and the order of
the work in a step. The rest has a module each:

- ``model_runner.py``: the forward passes (decode, packed and shared prefill, a long
  prompt's chunks) over the caches, with masks built by the engine and the LM head on the
  positions it samples from;
- ``running_batch.py``: the slots of the running rows (KV cache, per-row columns, output
  buffers, version segments);
- ``row_sampler.py``: one token per row, grouped by sampling params, with per-row
  counter-based noise (a row's tokens depend on its own seed and token index only);
- ``model_weights.py``: checking, loading (whole or streamed) and offloading the weights.

New weights are swapped in between steps (``load_weights``): running rows continue on
the cache they have (``keep``) or have it recomputed with the new weights
(``recompute``); every token records the version that sampled it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.engines.rollout.base import (
    SWAP_MODES,
    GenerationOutput,
    GenerationRequest,
    RequestEngine,
    RequestId,
    RequestResult,
    RolloutEngine,
    SamplingParams,
    check_generate_args,
)
from asyncflow.engines.rollout.model_runner import ModelRunner, Place, cache_keyword
from asyncflow.engines.rollout.model_weights import ModelWeights
from asyncflow.engines.rollout.row_sampler import RowSampler
from asyncflow.engines.rollout.running_batch import RunningBatch
from asyncflow.engines.rollout.slot_cache import PrefillCache

__all__ = ["BuiltinRolloutEngine", "cache_keyword"]


@dataclass
class _Chunked:
    """A long prompt being prefilled chunk by chunk, outside the running batch."""
    req: GenerationRequest
    cache: PrefillCache
    done: int = 0  # prompt tokens prefilled so far


class BuiltinRolloutEngine(RequestEngine, RolloutEngine):
    """Rollout engine over an in-process Hugging Face causal LM (Qwen2, Llama-style decoders).

    The engine takes the model over: it moves it to `device`, puts it in eval mode and
    updates its weights in place in `load_weights`.

    max_running_rows: rows decoded together; max_kv_tokens: the cache positions the
    running rows may reserve (prompt + budget each; 0 = no limit besides the rows);
    prefill_chunk: prompt tokens prefilled per step (a longer prompt is split over steps);
    max_context: prompt + budget limit of one request (default: the model's
    max_position_embeddings); lora_scale: the policy trains LoRA adapters (alpha / rank):
    versions may carry adapters, merged into the weights (lora_apply.py).
    """

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: list[int], pad_token_id: int,
                 device: torch.device | str | None = None, max_running_rows: int = 256, max_kv_tokens: int = 0,
                 prefill_chunk: int = 2048, max_context: int | None = None,
                 lora_scale: float | None = None) -> None:
        if max_running_rows < 1 or prefill_chunk < 1 or max_kv_tokens < 0:
            raise ValueError(f"BuiltinRolloutEngine: max_running_rows ({max_running_rows}) and prefill_chunk "
                             f"({prefill_chunk}) must be >= 1, max_kv_tokens ({max_kv_tokens}) >= 0")
        self.runner = ModelRunner(model, device=device, pad_token_id=pad_token_id)
        self.model = model
        self.device = self.runner.device
        self.vocab_size = self.runner.vocab_size
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos:
            raise ValueError("BuiltinRolloutEngine needs at least one eos token id")
        self._check_ids(eos, "eos_token_ids")
        self.pad_token_id = self.runner.pad_token_id
        self._check_ids((self.pad_token_id,), "pad_token_id")
        self.weights = ModelWeights(model, self.device, lora_scale)
        self.sampler = RowSampler(self.vocab_size, eos, self.device)
        self.max_running_rows = int(max_running_rows)
        self.max_kv_tokens = int(max_kv_tokens)
        self.prefill_chunk = int(prefill_chunk)
        self.admit_batch = max(1, self.max_running_rows // 8)  # free slots that make a prefill worth its forward
        self.max_context = int(max_context if max_context is not None
                               else getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 30)
        self.version = 0
        self._released = False
        # the scheduler's state
        self.batch = RunningBatch(self.runner.num_layers, self.device, self.max_running_rows)
        self._waiting: deque[GenerationRequest] = deque()
        self._chunked: _Chunked | None = None
        self._abort_ids: set[RequestId] = set()
        self._known: set[RequestId] = set()  # ids waiting, prefilling or running
        self._ready: list[RequestResult] = []  # finished outside a decode (errors, aborts, zero budgets)
        self._reserved_kv = 0
        self._admitting = True
        self.counters = {"finished": 0, "aborted": 0, "unknown_aborts": 0, "errors": 0, "swaps": 0,
                         "tokens": 0, "steps": 0, "prefill_tokens": 0, "prefill_shared_rows": 0, "recomputed_rows": 0}

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that stop a row (unless its params ignore eos)."""
        return self.sampler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.sampler.set_eos(tuple(int(t) for t in ids))

    @property
    def torn(self) -> str | None:
        """Why the weights are half-loaded (then the engine refuses to run); None when whole."""
        return self.weights.torn

    # ---- the request API -----------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self._known:
            raise ValueError(f"add_request: request id {request.request_id!r} is already queued or running")
        if not isinstance(request.params, SamplingParams):
            raise TypeError(f"request {request.request_id!r}: params must be a SamplingParams, "
                            f"got {type(request.params).__name__}")
        problem = self._request_problem(request)
        if problem is not None:
            self.counters["errors"] += 1
            self._ready.append(self._empty(request, "error", f"request {request.request_id!r}: {problem}"))
            return
        self._queue(request)

    def _queue(self, request: GenerationRequest) -> None:
        self._known.add(request.request_id)
        self._waiting.append(request)

    def abort(self, request_id: RequestId) -> bool:
        if request_id not in self._known:
            self.counters["unknown_aborts"] += 1
            return False
        self._abort_ids.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._chunked is not None or self.batch.rows or self._ready)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "running": len(self.batch), "waiting": len(self._waiting),
                "prefilling": int(self._chunked is not None),
                "version": int(self.version), "kv_reserved_tokens": self._reserved_kv,
                "kv_cache_bytes": self.batch.cache.nbytes}

    def new_tokens(self, since: Mapping[RequestId, int]) -> dict[RequestId, tuple[list[int], list[float]]]:
        return self.batch.new_tokens(since)

    def admit(self, on: bool) -> None:
        """Let waiting requests join the batch (the default), or hold them in the queue (a service
        draining the batch before a weight swap)."""
        self._admitting = bool(on)

    def step(self) -> list[RequestResult]:
        if self._released:
            raise RuntimeError("BuiltinRolloutEngine.step after release_memory(): call resume_memory() first")
        if self.torn is not None:
            raise RuntimeError(f"BuiltinRolloutEngine: refusing to generate with half-loaded weights ({self.torn})")
        with torch.inference_mode():
            return self._step()

    # ---- one scheduling iteration --------------------------------------------------------
    def _step(self) -> list[RequestResult]:
        done, self._ready = self._ready, []
        if self._abort_ids:
            done += self._take_aborts()
        parts = []
        if self.batch.rows:  # decode: feed each row's last sampled token
            parts.append(self.runner.decode(self.batch.col["pending"], self.batch.cache))
        new_hidden = self._admit(done)
        if new_hidden is not None:
            parts.append(new_hidden)
        if not parts:
            return done
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        done += self._sample(hidden)
        self.counters["steps"] += 1
        return done

    def _sample(self, hidden: torch.Tensor) -> list[RequestResult]:
        """Sample one token per running row, record it, and retire the rows that finished."""
        batch, col = self.batch, self.batch.col
        tok, lp, stopped = self.sampler.sample(self.runner.logits(hidden), [r.req.params for r in batch.rows],
                                               col["key_a"], col["key_b"], col["steps"])
        batch.record(tok, lp)
        self.counters["tokens"] += len(batch)
        done = stopped | (col["steps"] >= col["budget"])
        if not bool(done.any()):
            return []
        finished = [self._result(j, steps, "stop" if s else "length")
                    for j, (d, s, steps) in enumerate(zip(done.tolist(), stopped.tolist(), col["steps"].tolist())) if d]
        self._retire(~done)
        return finished

    def _retire(self, keep: torch.Tensor) -> None:
        """Drop the finished rows from the batch and from the scheduler's books."""
        for row in self.batch.retire(keep):
            self._reserved_kv -= row.plen + row.req.budget
            self._known.discard(row.req.request_id)
            self._abort_ids.discard(row.req.request_id)

    def _result(self, slot: int, steps: int, reason: str) -> RequestResult:
        if reason == "abort":
            self.counters["aborted"] += 1
        else:
            self.counters["finished"] += 1
        return self.batch.result(slot, steps, reason)

    def _empty(self, req: GenerationRequest, reason: str, error: str | None = None) -> RequestResult:
        return RequestResult(req.request_id, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32),
                             torch.empty(0, dtype=torch.int64), reason, error)

    def _take_aborts(self) -> list[RequestResult]:
        """Aborted requests finish now: running rows with the tokens they have, queued ones empty."""
        out = []
        rows = self.batch.rows
        hit = [r.req.request_id in self._abort_ids for r in rows]
        if any(hit):
            steps = self.batch.steps()
            out += [self._result(j, steps[j], "abort") for j in range(len(rows)) if hit[j]]
            self._retire(~torch.tensor(hit, device=self.device))
        if any(r.request_id in self._abort_ids for r in self._waiting):
            keep: deque[GenerationRequest] = deque()
            for r in self._waiting:
                if r.request_id in self._abort_ids:
                    out.append(self._forget_queued(r))
                else:
                    keep.append(r)
            self._waiting = keep
        if self._chunked is not None and self._chunked.req.request_id in self._abort_ids:
            out.append(self._forget_queued(self._chunked.req))
            self._reserved_kv -= self._chunked.req.prompt_ids.numel() + self._chunked.req.budget
            self._chunked = None
        return out

    def _forget_queued(self, req: GenerationRequest) -> RequestResult:
        self._known.discard(req.request_id)
        self._abort_ids.discard(req.request_id)
        self.counters["aborted"] += 1
        return self._empty(req, "abort")

    # ---- admission and prefill -----------------------------------------------------------
    def _request_problem(self, req: GenerationRequest) -> str | None:
        p = req.prompt_ids
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            return f"prompt must be a non-empty 1-D token tensor, got {got}"
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            return f"prompt must hold integer token ids, got dtype {p.dtype}"
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= self.vocab_size:
            return f"prompt has token ids in [{lo}, {hi}], outside the vocab [0, {self.vocab_size})"
        if req.budget < 0:
            return f"max_new_tokens must be >= 0, got {req.budget}"
        bad = [t for t in req.params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"stop_token_ids {bad} outside the vocab [0, {self.vocab_size})"
        need = p.numel() + req.budget
        if need > self.max_context:
            return (f"prompt ({p.numel()} tokens) + max_new_tokens ({req.budget}) = {need} exceeds the context of "
                    f"{self.max_context} tokens; shorten the prompt or lower the budget")
        if self.max_kv_tokens and need > self.max_kv_tokens:
            return (f"prompt + max_new_tokens = {need} tokens exceeds rollout max_kv_tokens={self.max_kv_tokens}; "
                    "raise it or lower the budget")
        return None

    def _admit(self, done: list[RequestResult]) -> torch.Tensor | None:
        """Move waiting requests into free slots (prefilling them); return their last hidden states."""
        hidden_parts: list[torch.Tensor] = []
        seqs: list[torch.Tensor] = []
        taken: list[GenerationRequest] = []
        budget_tokens = self.prefill_chunk
        if self._chunked is not None:  # a long prompt in progress has this step's prefill budget first
            h = self._prefill_chunk_step(self._chunked)
            budget_tokens = 0
            if h is not None:
                hidden_parts.append(h)
        # Admissions are batched: a prefill is a forward pass of its own, whose fixed cost (most of
        # a small model's step) is paid once for several rows rather than once per freed slot.
        running = len(self.batch)
        free = self.max_running_rows - running - (self._chunked is not None)
        if running and free < min(self.admit_batch, len(self._waiting)):
            budget_tokens = 0
        while self._waiting and budget_tokens > 0 and self._admitting:
            req = self._waiting[0]
            if req.min_version > self.version:
                break  # staleness bound: wait for newer weights (rows keep their order)
            plen = req.prompt_ids.numel()
            if req.budget == 0:
                self._waiting.popleft()
                self._known.discard(req.request_id)
                self.counters["finished"] += 1
                done.append(self._empty(req, "length"))
                continue
            rows = len(self.batch) + len(taken) + (self._chunked is not None)
            need = plen + req.budget
            if rows >= self.max_running_rows or (self.max_kv_tokens and self._reserved_kv + need > self.max_kv_tokens):
                break
            self._waiting.popleft()
            self._reserved_kv += need
            if plen > budget_tokens:
                if taken or self._chunked is not None:  # next step: it starts with a full budget
                    self._waiting.appendleft(req)
                    self._reserved_kv -= need
                    break
                self._chunked = _Chunked(req, PrefillCache(self.runner.num_layers, 1, plen))
                h = self._prefill_chunk_step(self._chunked)
                if h is not None:
                    hidden_parts.append(h)
                break
            taken.append(req)
            seqs.append(req.prompt_ids)
            budget_tokens -= plen
        if taken:
            hidden_parts.append(self._join(taken, seqs))
        if not hidden_parts:
            return None
        return torch.cat(hidden_parts) if len(hidden_parts) > 1 else hidden_parts[0]

    def _join(self, reqs: list[GenerationRequest], seqs: list[torch.Tensor]) -> torch.Tensor:
        """Prefill new rows and append them to the running batch."""
        hidden, places = self._prefill(seqs)
        self._append(reqs, [s.numel() for s in seqs], places)
        return hidden

    def _prefill(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, list[Place]]:
        """Prefill sequences in one forward (``ModelRunner.prefill``); the last token's hidden state
        per sequence (in the order given) and where each one's keys and values lie."""
        out = self.runner.prefill(seqs)
        self.counters["prefill_shared_rows"] += out.shared
        return out.hidden, out.places

    def _prefill_chunk_step(self, ch: _Chunked) -> torch.Tensor | None:
        """Prefill the next chunk of the long prompt in progress; when it is complete, the row joins
        the batch and its last hidden state is returned."""
        prompt = ch.req.prompt_ids
        plen = prompt.numel()
        end = min(plen, ch.done + self.prefill_chunk)
        hidden = self.runner.prefill_span(prompt, ch.done, end, ch.cache)
        ch.done = end
        if end < plen:
            return None
        self._chunked = None
        self._append([ch.req], [plen], [(ch.cache, 0, 0)])
        return hidden

    def _append(self, reqs: list[GenerationRequest], plens: list[int], places: list[Place]) -> None:
        self.batch.append(reqs, plens, places, self.version)
        self.counters["prefill_tokens"] += sum(plens)

    # ---- the batch API, over the request API ---------------------------------------------
    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, *, seeds: list[int],
                 max_new_tokens: list[int] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> GenerationOutput:
        budgets = check_generate_args(prompts, params, seeds, max_new_tokens)
        if self._released:
            raise RuntimeError("BuiltinRolloutEngine.generate after release_memory(): call resume_memory() first")
        if self.has_work():
            raise RuntimeError("BuiltinRolloutEngine.generate while requests are queued or running "
                               "(a RolloutService drives this engine; submit through it)")
        ids: list[RequestId] = [f"generate-{i}" for i in range(len(prompts))]
        reqs = [GenerationRequest(ids[i], p, params, seeds[i], budgets[i]) for i, p in enumerate(prompts)]
        for i, req in enumerate(reqs):  # the batch is refused whole, before any row runs
            problem = self._request_problem(req)
            if problem is not None:
                raise ValueError(f"generate: prompt {i}: {problem}")
        for req in reqs:
            self._queue(req)
        results: dict[RequestId, RequestResult] = {}
        aborted = False
        while len(results) < len(prompts):
            if not aborted and should_abort is not None and should_abort():
                aborted = True
                for rid in ids:
                    if rid not in results:
                        self.abort(rid)
            for r in self.step():
                results[r.request_id] = r
        out = [results[rid] for rid in ids]
        return GenerationOutput([r.response_ids for r in out], [r.log_probs for r in out],
                                [r.finish_reason for r in out])

    # ---- weights and memory -------------------------------------------------------------
    def check_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Raise (naming the key) for weights this engine would refuse; changes nothing."""
        self.weights.check(state_dict, version, self.version)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights(state_dict, version)
        self.weights.load(state_dict)
        self._commit_version(version, mode)

    def load_weights_stream(self, specs: Sequence[Any], stream: Iterable[tuple[Any, torch.Tensor]], version: int,
                            mode: str = "keep") -> None:
        """Load a version tensor by tensor straight into the model (no second copy): ``specs``
        (name, shape, dtype of each) are checked before anything is written; a stream that
        fails midway leaves the engine refusing to generate (``torn``), never serving a mix."""
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights_stream: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights({s.name: s.meta() for s in specs}, version)
        self.weights.load_stream(specs, stream, version)
        self._commit_version(version, mode)

    def _commit_version(self, version: int, mode: str) -> None:
        """The weights of ``version`` are in: version the running rows' next tokens (and re-prefill them)."""
        changed = int(version) != self.version
        self.version = int(version)
        self.counters["swaps"] += 1
        if changed:  # the next token of every running row is the new version's
            self.batch.new_version(self.version)
        if mode == "recompute" and self.batch.rows:
            with torch.inference_mode():
                self._recompute()
        if mode == "recompute" and self._chunked is not None:
            self._chunked.done = 0  # its prompt is prefilled again from the start, with the new weights

    def _recompute(self) -> None:
        """Re-prefill every running row (prompt + tokens fed so far) with the weights now held."""
        seqs = self.batch.fed_sequences()
        # by length, in forwards of at most prefill_chunk tokens (or one sequence): the running
        # rows can hold far more tokens than one forward should take
        order = sorted(range(len(seqs)), key=lambda j: seqs[j].numel())
        start = 0
        while start < len(order):
            end, tokens = start, 0
            while end < len(order) and (end == start or tokens + seqs[order[end]].numel() <= self.prefill_chunk):
                tokens += seqs[order[end]].numel()
                end += 1
            part = order[start:end]
            _, places = self._prefill([seqs[j] for j in part])
            self.batch.cache.overwrite(part, places, [seqs[j].numel() for j in part])
            start = end
        self.counters["recomputed_rows"] += len(seqs)

    def memory_held(self) -> dict[str, int]:
        """Bytes this engine holds now: ``weights`` (parameters and buffers, wherever they are)
        and ``kv_cache`` (the running batch's cache buffers, kept between steps for reuse)."""
        chunked = ([t for t in self._chunked.cache.keys + self._chunked.cache.values if t is not None]
                   if self._chunked is not None else [])
        kv = self.batch.cache.nbytes + sum(t.numel() * t.element_size() for t in chunked)
        return {"weights": self.weights.nbytes(), "kv_cache": kv}

    def release_memory(self) -> None:
        """Give back what generation used, for a colocated trainer; weights are kept (load_weights
        works while released) and step/generate refuse to run until resume_memory().

        The cache buffers are dropped (they are kept between steps otherwise). On an
        accelerator the weights go to host memory and empty_cache returns every free block to
        the device. On the CPU the colocated roles share this process's heap, so what
        generation freed is reused by the next role; returning it to the OS (malloc_trim)
        only made the next generate fault it back in, so nothing more is done there.
        """
        if self.has_work():
            raise RuntimeError("BuiltinRolloutEngine.release_memory while requests are queued or running")
        self.batch.release()
        if self.device.type != "cpu":
            self.sampler.to("cpu")
        self.weights.offload()
        self._released = True

    def resume_memory(self) -> None:
        self.weights.restore()
        if self.device.type != "cpu":
            self.sampler.to(self.device)
        self._released = False

    def _check_ids(self, ids: tuple[int, ...], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad} outside the vocab [0, {self.vocab_size})")
