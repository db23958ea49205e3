"""The built-in rollout engine: continuous batching of a Hugging Face causal LM with a KV cache.

Made for CPU (AsyncFlow's default engine on a laptop) and correct on any device. It is
driven request by request (``RequestEngine``): each ``step()`` decodes one token for
every running row, admits waiting requests into the slots that finished rows left
(their prefill runs in the same step, a long prompt in chunks over several steps), and
returns the rows that finished. So the compute follows the rows that are generating,
and a row never waits for the longest row of its batch. ``generate()`` (the batch API)
submits its prompts and steps until they are all done.

What else makes it fast on small models: prompts prefilled packed end to end (no padding)
and once per distinct prompt (a GRPO group shares one), a preallocated cache written in place
(``SlotKVCache``), grouped-query attention that reads the cache without copying it
(``attention.py``), masks built by the engine (HF models accept a prepared mask dict), the
LM head on the last position only, and sampling as a few whole-batch tensor ops with
per-row counter-based noise (``sampling.sample_step``), so a row's tokens depend on its
own seed and token index only, never on which rows share the batch.

New weights are swapped in between steps (``load_weights``): running rows continue on
the cache they have (``keep``) or have it recomputed with the new weights
(``recompute``); every token records the version that sampled it.
"""
from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.engines.rollout.attention import GROUPED, use_grouped_attention
from asyncflow.engines.rollout.base import (
    SWAP_MODES,
    GenerationOutput,
    GenerationRequest,
    RequestEngine,
    RequestResult,
    RolloutEngine,
    SamplingParams,
    check_generate_args,
)
from asyncflow.engines.rollout.lora_apply import AdapterMerge, is_adapter_name
from asyncflow.engines.rollout.sampling import SeedKeys, _splitmix64, sample_step, vocab_hash
from asyncflow.engines.rollout.slot_cache import PrefillCache, SlotKVCache
from asyncflow.engines.row_packing import pack_rows

__all__ = ["BuiltinRolloutEngine"]

# Config attributes that make a model's logits more than `lm_head(hidden)`; the engine
# computes logits itself, so it refuses such models rather than sample from wrong ones.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_MASK32 = 0xFFFFFFFF
# Prefill packs prompts into rows of at most this many tokens (or the longest prompt):
# attention inside a packed row costs width^2, padding rows to one width costs whole tokens.
PACK_WIDTH = 128


@dataclass
class _Row:
    """Python-side state of a running row (its tensors live in the engine's per-slot columns)."""
    req: GenerationRequest
    plen: int
    versions: list[tuple[int, int]]  # (first token index, policy version) segments


@dataclass
class _Chunked:
    """A long prompt being prefilled chunk by chunk, outside the running batch."""
    req: GenerationRequest
    cache: PrefillCache
    done: int = 0  # prompt tokens prefilled so far


def cache_keyword(base: torch.nn.Module) -> str:
    """The keyword a decoder stack's forward takes its KV cache by: ``cache`` from transformers
    5.24, ``past_key_values`` before. Passed by the wrong name, the cache is swallowed by
    ``**kwargs`` and the model fills a DynamicCache of its own instead of ours."""
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(f"BuiltinRolloutEngine: {type(base).__name__}.forward takes neither 'cache' nor "
                     f"'past_key_values' (its parameters: {', '.join(params)}); it cannot run on the engine's KV cache")


def _params_key(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_k, p.top_p, p.stop_token_ids, p.ignore_eos)


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
        cfg = model.config
        attn = getattr(cfg, "_attn_implementation", None)
        if attn not in ("eager", "sdpa", GROUPED):  # GROUPED: a model another engine took over before
            raise ValueError(f"BuiltinRolloutEngine needs attn_implementation 'eager' or 'sdpa' "
                             f"(it passes additive float masks), the model has {attn!r}")
        layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError("BuiltinRolloutEngine supports full attention layers only, the model has "
                             f"{sorted(layer_types)}")
        for name in _HEAD_MODIFIERS:
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                raise ValueError(f"BuiltinRolloutEngine computes logits as lm_head(hidden); the model sets "
                                 f"config.{name}={getattr(cfg, name)!r}, which it does not apply")
        if max_running_rows < 1 or prefill_chunk < 1 or max_kv_tokens < 0:
            raise ValueError(f"BuiltinRolloutEngine: max_running_rows ({max_running_rows}) and prefill_chunk "
                             f"({prefill_chunk}) must be >= 1, max_kv_tokens ({max_kv_tokens}) >= 0")
        # Both take additive float masks, as the engine builds them; the engine then runs the model
        # with its own grouped-query attention (same math, no copy of the cache per step).
        use_grouped_attention(model)
        self.model = model
        self._lora = AdapterMerge(model, lora_scale) if lora_scale is not None else None
        self.base = getattr(model, model.base_model_prefix)  # the decoder stack without the LM head
        self._cache_kw = cache_keyword(self.base)
        self.head = model.get_output_embeddings()
        if self.base is None or self.head is None:
            raise ValueError(f"{type(model).__name__} has no base model / output embeddings to call separately")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self.device).eval()
        self.num_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(self.head.weight.shape[0])
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("BuiltinRolloutEngine needs at least one eos token id")
        self._check_ids(self.eos_token_ids, "eos_token_ids")
        self.pad_token_id = int(pad_token_id)
        self._check_ids((self.pad_token_id,), "pad_token_id")
        self.max_running_rows = int(max_running_rows)
        self.max_kv_tokens = int(max_kv_tokens)
        self.prefill_chunk = int(prefill_chunk)
        self.admit_batch = max(1, self.max_running_rows // 8)  # free slots that make a prefill worth its forward
        self.max_context = int(max_context if max_context is not None
                               else getattr(cfg, "max_position_embeddings", None) or 1 << 30)
        self.version = 0
        self._released = False
        self.torn: str | None = None  # why the weights are half-loaded (then the engine refuses to run)
        self._vhash = vocab_hash(self.vocab_size, self.device)
        self._dtype = self.head.weight.dtype
        self._neg = torch.finfo(self._dtype).min
        # the scheduler's state
        self._waiting: deque[GenerationRequest] = deque()
        self._chunked: _Chunked | None = None
        self._rows: list[_Row] = []  # slot order
        self._cache = SlotKVCache(self.num_layers)
        self._col: dict[str, torch.Tensor] = {}  # per-slot int64 columns: steps, budget, key_a, key_b, pending
        self._out_tok = torch.zeros((0, 0), dtype=torch.int64, device=self.device)
        self._out_lp = torch.zeros((0, 0), dtype=torch.float32, device=self.device)
        self._abort_ids: set = set()
        self._known: set = set()  # ids waiting, prefilling or running
        self._ready: list[RequestResult] = []  # finished outside a decode (errors, aborts, zero budgets)
        self._stop_masks: dict[tuple, torch.Tensor] = {}
        self._reserved_kv = 0
        self._admitting = True
        self.counters = {"finished": 0, "aborted": 0, "unknown_aborts": 0, "errors": 0, "swaps": 0,
                         "tokens": 0, "steps": 0, "prefill_tokens": 0, "prefill_shared_rows": 0, "recomputed_rows": 0}

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

    def abort(self, request_id: int | str) -> bool:
        if request_id not in self._known:
            self.counters["unknown_aborts"] += 1
            return False
        self._abort_ids.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._chunked is not None or self._rows or self._ready)

    def stats(self) -> dict:
        return {**self.counters, "running": len(self._rows), "waiting": len(self._waiting),
                "prefilling": int(self._chunked is not None),
                "version": int(self.version), "kv_reserved_tokens": self._reserved_kv,
                "kv_cache_bytes": self._cache.nbytes}

    def new_tokens(self, since: Mapping[int | str, int]) -> dict[int | str, tuple[list[int], list[float]]]:
        if not since or not self._rows:
            return {}
        steps = self._col["steps"].tolist()
        out = {}
        for j, row in enumerate(self._rows):
            seen = since.get(row.req.request_id)
            if seen is not None and steps[j] > seen:
                out[row.req.request_id] = (self._out_tok[j, seen:steps[j]].tolist(),
                                           self._out_lp[j, seen:steps[j]].tolist())
        return out

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
        if self._rows:  # decode: feed each row's last sampled token
            parts.append(self._decode_running())
        new_hidden = self._admit(done)
        if new_hidden is not None:
            parts.append(new_hidden)
        if not parts:
            return done
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        done += self._sample(hidden)
        self.counters["steps"] += 1
        return done

    def _decode_running(self) -> torch.Tensor:
        cache = self._cache
        width = cache.begin_decode()
        lens = cache.lens
        mask = torch.zeros((cache.n, 1, 1, width), dtype=self._dtype, device=self.device)
        mask.masked_fill_(torch.arange(width, device=self.device)[None, None, None, :] > lens[:, None, None, None],
                          self._neg)
        hidden = self._forward(self._col["pending"][:, None], mask, lens[:, None], cache)
        cache.end_decode()
        return hidden

    def _sample(self, hidden: torch.Tensor) -> list[RequestResult]:
        """Sample one token per running row, record it, and retire the rows that finished."""
        col, n = self._col, len(self._rows)
        logits = self.head(hidden).float()
        groups: dict[tuple, list[int]] = {}
        for j, r in enumerate(self._rows):
            groups.setdefault(_params_key(r.req.params), []).append(j)
        if len(groups) == 1:
            params = self._rows[0].req.params
            tok, lp = self._sample_rows(logits, params, col["key_a"], col["key_b"], col["steps"])
            stopped = self._stop_mask(params)[tok]
        else:
            tok = torch.empty(n, dtype=torch.int64, device=self.device)
            lp = torch.empty(n, dtype=torch.float32, device=self.device)
            stopped = torch.empty(n, dtype=torch.bool, device=self.device)
            for rows in groups.values():
                idx = torch.tensor(rows, device=self.device)
                params = self._rows[rows[0]].req.params
                t, t_lp = self._sample_rows(logits[idx], params, col["key_a"][idx], col["key_b"][idx],
                                            col["steps"][idx])
                tok[idx], lp[idx], stopped[idx] = t, t_lp, self._stop_mask(params)[t]
        slots = torch.arange(n, device=self.device)
        self._out_tok[slots, col["steps"]] = tok
        self._out_lp[slots, col["steps"]] = lp
        col["steps"] = col["steps"] + 1
        col["pending"] = tok
        self.counters["tokens"] += n
        done = stopped | (col["steps"] >= col["budget"])
        if not bool(done.any()):
            return []
        finished = [self._result(self._rows[j], j, steps, "stop" if s else "length")
                    for j, (d, s, steps) in enumerate(zip(done.tolist(), stopped.tolist(), col["steps"].tolist())) if d]
        self._retire(~done)
        return finished

    def _sample_rows(self, logits: torch.Tensor, params: SamplingParams, key_a: torch.Tensor, key_b: torch.Tensor,
                     steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = None if params.greedy else SeedKeys.of(key_a, key_b)
        return sample_step(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           keys=keys, step=steps, vhash=self._vhash)

    def _stop_mask(self, params: SamplingParams) -> torch.Tensor:
        key = (params.stop_token_ids, params.ignore_eos)
        m = self._stop_masks.get(key)
        if m is None:
            m = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            m[([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)] = True
            self._stop_masks[key] = m
        return m

    def _retire(self, keep: torch.Tensor) -> None:
        """Drop the finished rows from the batch; survivors move into their slots."""
        order = self._cache.compact(keep)
        for row, k in zip(self._rows, keep.tolist()):
            if not k:
                self._reserved_kv -= row.plen + row.req.budget
                self._known.discard(row.req.request_id)
                self._abort_ids.discard(row.req.request_id)
        self._rows = [self._rows[int(i)] for i in order]
        o = order.to(self.device)
        self._col = {k: v[o] for k, v in self._col.items()}
        m = o.numel()
        self._out_tok[:m] = self._out_tok[o]
        self._out_lp[:m] = self._out_lp[o]

    def _result(self, row: _Row, slot: int, steps: int, reason: str) -> RequestResult:
        versions = torch.empty(steps, dtype=torch.int64)
        bounds = [s for s, _ in row.versions[1:]] + [steps]
        for (start, v), end in zip(row.versions, bounds):
            versions[start:end] = v
        if reason == "abort":
            self.counters["aborted"] += 1
        else:
            self.counters["finished"] += 1
        # copy=True: on the CPU .cpu() would return a view of buffers the next rows overwrite
        return RequestResult(row.req.request_id, self._out_tok[slot, :steps].to("cpu", copy=True),
                             self._out_lp[slot, :steps].to("cpu", copy=True), versions, reason)

    def _empty(self, req: GenerationRequest, reason: str, error: str | None = None) -> RequestResult:
        return RequestResult(req.request_id, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32),
                             torch.empty(0, dtype=torch.int64), reason, error)

    def _take_aborts(self) -> list[RequestResult]:
        """Aborted requests finish now: running rows with the tokens they have, queued ones empty."""
        out = []
        hit = [r.req.request_id in self._abort_ids for r in self._rows]
        if any(hit):
            steps = self._col["steps"].tolist()
            out += [self._result(r, j, steps[j], "abort") for j, r in enumerate(self._rows) if hit[j]]
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
        hidden_parts, seqs, taken = [], [], []
        budget_tokens = self.prefill_chunk
        if self._chunked is not None:  # a long prompt in progress has this step's prefill budget first
            h = self._prefill_chunk_step()
            budget_tokens = 0
            if h is not None:
                hidden_parts.append(h)
        # Admissions are batched: a prefill is a forward pass of its own, whose fixed cost (most of
        # a small model's step) is paid once for several rows rather than once per freed slot.
        free = self.max_running_rows - len(self._rows) - (self._chunked is not None)
        if self._rows and free < min(self.admit_batch, len(self._waiting)):
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
            rows = len(self._rows) + len(taken) + (self._chunked is not None)
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
                self._chunked = _Chunked(req, PrefillCache(self.num_layers, 1, plen))
                h = self._prefill_chunk_step()
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

    def _append(self, reqs: list[GenerationRequest], plens: list[int],
                places: list[tuple[PrefillCache, int, int]]) -> None:
        n0, m = len(self._rows), len(reqs)
        cap = max(p + r.budget for p, r in zip(plens, reqs))
        gen_cap = max(r.budget for r in reqs)
        self._cache.reserve(n0 + m, cap, places[0][0], self.max_running_rows)
        self._reserve_out(n0 + m, gen_cap)
        self._cache.append(places, plens)
        mixed = [_splitmix64(int(r.seed)) for r in reqs]
        new = {"steps": torch.zeros(m, dtype=torch.int64),
               "budget": torch.tensor([r.budget for r in reqs], dtype=torch.int64),
               "key_a": torch.tensor([x & _MASK32 for x in mixed], dtype=torch.int64),
               "key_b": torch.tensor([x >> 32 for x in mixed], dtype=torch.int64),
               "pending": torch.zeros(m, dtype=torch.int64)}
        for k, v in new.items():
            v = v.to(self.device)
            self._col[k] = torch.cat([self._col[k][:n0], v]) if n0 else v
        self._rows += [_Row(r, p, [(0, int(self.version))]) for r, p in zip(reqs, plens)]
        self.counters["prefill_tokens"] += sum(plens)

    def _reserve_out(self, rows: int, gen_cap: int) -> None:
        r, c = self._out_tok.shape
        if rows <= r and gen_cap <= c:
            return
        nr = max(rows, r) if rows <= r else min(max(rows, r * 3 // 2), max(self.max_running_rows, rows))
        nc = max(gen_cap, c)
        tok = torch.zeros((nr, nc), dtype=torch.int64, device=self.device)
        lp = torch.zeros((nr, nc), dtype=torch.float32, device=self.device)
        n = len(self._rows)
        tok[:n, :c] = self._out_tok[:n]
        lp[:n, :c] = self._out_lp[:n]
        self._out_tok, self._out_lp = tok, lp

    def _prefill(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[PrefillCache, int, int]]]:
        """Prefill sequences in one forward; return the last token's hidden state per sequence (in
        the order given) and where each one's keys and values lie: (staging cache, row, offset).
        Identical sequences (a GRPO group's prompt) are computed once and share their place: the
        slots get copies, so the rows stay independent from then on."""
        index: dict[tuple[int, ...], int] = {}
        unique: list[torch.Tensor] = []
        of: list[int] = []  # sequence i is unique[of[i]]
        for q in seqs:
            key = tuple(q.tolist())
            if key not in index:
                index[key] = len(unique)
                unique.append(q)
            of.append(index[key])
        if len(unique) == len(seqs):
            return self._prefill_packed(seqs)
        hidden, places = self._prefill_packed(unique)
        self.counters["prefill_shared_rows"] += len(seqs) - len(unique)
        return hidden[torch.tensor(of, device=hidden.device)], [places[o] for o in of]

    def _prefill_packed(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[PrefillCache, int, int]]]:
        """Run sequences through the model in one forward, packed end to end into rows of at most
        max(PACK_WIDTH, longest) tokens brought near one length (``row_packing``: padding is
        compute thrown away). A block-diagonal causal mask and per-sequence positions keep each
        sequence to itself."""
        lens = [s.numel() for s in seqs]
        bins = pack_rows(lens, PACK_WIDTH)
        rows, width = len(bins), max(sum(lens[i] for i in members) for members in bins)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.int64)
        positions = torch.zeros((rows, width), dtype=torch.int64)
        segment = torch.full((rows, width), -1, dtype=torch.int64)  # padding: a segment of its own
        where: list[tuple[int, int]] = [(0, 0)] * len(seqs)
        for r, members in enumerate(bins):
            off = 0
            for i in members:
                n = lens[i]
                ids[r, off:off + n] = seqs[i]
                positions[r, off:off + n] = torch.arange(n)
                segment[r, off:off + n] = i
                where[i] = (r, off)
                off += n
        segment = segment.to(self.device)
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        allowed = (segment[:, :, None] == segment[:, None, :]) & causal
        mask = torch.zeros((rows, 1, width, width), dtype=self._dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], self._neg)
        cache = PrefillCache(self.num_layers, rows, width)
        out = self._run_base(ids.to(self.device), mask, positions.to(self.device), cache)
        last = torch.tensor([r * width + off + n - 1 for (r, off), n in zip(where, lens)], device=self.device)
        return out.reshape(rows * width, -1)[last], [(cache, r, off) for r, off in where]

    def _prefill_chunk_step(self) -> torch.Tensor | None:
        """Prefill the next chunk of the long prompt in progress; when it is complete, the row joins
        the batch and its last hidden state is returned."""
        ch = self._chunked
        prompt = ch.req.prompt_ids
        plen = prompt.numel()
        end = min(plen, ch.done + self.prefill_chunk)
        q = end - ch.done
        ids = prompt[ch.done:end].to(self.device, torch.int64)[None]
        mask = self._causal(q, ch.done, 1)
        positions = torch.arange(ch.done, end, device=self.device)[None]
        ch.cache.offset = ch.done
        out = self._run_base(ids, mask, positions, ch.cache)
        ch.done = end
        if end < plen:
            return None
        self._chunked = None
        hidden = out[:, -1]
        self._append([ch.req], [plen], [(ch.cache, 0, 0)])
        return hidden

    def _causal(self, q: int, offset: int, rows: int) -> torch.Tensor:
        """Additive mask [rows, 1, q, offset + q]: query i (at position offset + i) sees keys <= it."""
        keys = torch.arange(offset + q, device=self.device)
        queries = torch.arange(offset, offset + q, device=self.device)
        mask = torch.zeros((q, offset + q), dtype=self._dtype, device=self.device)
        mask.masked_fill_(keys[None, :] > queries[:, None], self._neg)
        return mask[None, None].expand(rows, 1, q, offset + q)

    def _run_base(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Run the decoder stack on our cache and mask; the hidden states [rows, q, hidden]."""
        out = self.base(input_ids=ids, attention_mask={"full_attention": mask}, position_ids=positions,
                        use_cache=True, **{self._cache_kw: cache})
        return out.last_hidden_state

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Run the decoder stack; return the last position's hidden state [rows, hidden]."""
        return self._run_base(ids, mask, positions, cache)[:, -1]

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
        ids = [("generate", i) for i in range(len(prompts))]
        reqs = [GenerationRequest(ids[i], p, params, seeds[i], budgets[i]) for i, p in enumerate(prompts)]
        for i, req in enumerate(reqs):  # the batch is refused whole, before any row runs
            problem = self._request_problem(req)
            if problem is not None:
                raise ValueError(f"generate: prompt {i}: {problem}")
        for req in reqs:
            self._queue(req)
        results: dict = {}
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
    def check_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Raise (naming the key) for weights this engine would refuse; changes nothing."""
        if int(version) < self.version:
            raise ValueError(f"load_weights: version {version} is older than the version held ({self.version}); "
                             "refused, the engine keeps its weights")
        target = self.model.state_dict()
        adapters = {k: v for k, v in state_dict.items() if is_adapter_name(k)}
        if adapters:
            if self._lora is None:
                raise KeyError(f"load_weights: LoRA adapters ({next(iter(adapters))!r}, ...) sent to an engine built "
                               "without LoRA (lora_scale)")
            self._lora.check(adapters, target)
            state_dict = {k: v for k, v in state_dict.items() if k not in adapters}
            if not state_dict:  # adapters only: the base weights held stay
                return
        unknown = sorted(k for k in state_dict if k not in target)
        if unknown:
            raise KeyError(f"load_weights: unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                           f"(expected the model's state_dict names, e.g. {next(iter(target))!r})")
        for k, v in state_dict.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"load_weights: {k!r} is a {type(v).__name__}, not a tensor")
            if tuple(v.shape) != tuple(target[k].shape):
                raise ValueError(f"load_weights: shape mismatch for {k!r}: got {tuple(v.shape)}, "
                                 f"the model has {tuple(target[k].shape)}")
            if v.dtype != target[k].dtype:
                raise TypeError(f"load_weights: dtype mismatch for {k!r}: got {v.dtype}, the model holds "
                                f"{target[k].dtype} (send weights in the rollout dtype)")
        # Tied weights (embeddings / LM head) are one tensor under two names: either name will do.
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for k, t in target.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(k)
        missing = sorted(names[0] for names in groups.values() if not any(n in state_dict for n in names))
        if missing:
            raise KeyError(f"load_weights: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                           f"({len(missing)} in all; a full state_dict is required)")

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights(state_dict, version)
        target = self.model.state_dict()
        if self._lora is not None:
            self._lora.begin()
        with torch.no_grad():
            for k, v in state_dict.items():
                if self._lora is None or not self._lora.take(k, v):
                    target[k].copy_(v)  # in place: moves to the device as needed
            if self._lora is not None:
                self._lora.end(target)
        self._commit_version(version, mode)

    def load_weights_stream(self, specs: Sequence[Any], stream: Iterable[tuple[Any, torch.Tensor]], version: int,
                            mode: str = "keep") -> None:
        """Load a version tensor by tensor straight into the model (no second copy): ``specs``
        (name, shape, dtype of each) are checked before anything is written; a stream that
        fails midway leaves the engine refusing to generate (``torn``), never serving a mix."""
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights_stream: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights({s.name: s.meta() for s in specs}, version)
        target = self.model.state_dict()
        done = 0
        if self._lora is not None:
            self._lora.begin()
        try:
            with torch.no_grad():
                for spec, t in stream:
                    if self._lora is None or not self._lora.take(spec.name, t):
                        target[spec.name].copy_(t)
                    done += 1
                if self._lora is not None and done == len(specs):
                    self._lora.end(target)
        except BaseException as e:
            self.torn = f"version {version}: {done} of {len(specs)} tensors loaded when the stream failed: {e}"
            raise
        if done != len(specs):
            self.torn = f"version {version}: the stream ended after {done} of {len(specs)} tensors"
            raise RuntimeError(f"load_weights_stream: {self.torn}")
        self.torn = None
        self._commit_version(version, mode)

    def _commit_version(self, version: int, mode: str) -> None:
        """The weights of ``version`` are in: version the running rows' next tokens (and re-prefill them)."""
        changed = int(version) != self.version
        self.version = int(version)
        self.counters["swaps"] += 1
        if changed:
            # the next token of every running row is the new version's
            steps = self._col["steps"].tolist() if self._rows else []
            for row, s in zip(self._rows, steps):
                row.versions.append((s, self.version))
        if mode == "recompute" and self._rows:
            with torch.inference_mode():
                self._recompute()
        if mode == "recompute" and self._chunked is not None:
            self._chunked.done = 0  # its prompt is prefilled again from the start, with the new weights

    def _recompute(self) -> None:
        """Re-prefill every running row (prompt + tokens fed so far) with the weights now held."""
        steps = self._col["steps"].tolist()
        seqs = []
        for j, (row, s) in enumerate(zip(self._rows, steps)):
            fed = self._out_tok[j, :s - 1].cpu()  # the last sampled token is fed by the next decode
            seqs.append(torch.cat([row.req.prompt_ids.to(torch.int64), fed]))
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
            self._cache.overwrite(part, places, [seqs[j].numel() for j in part])
            start = end
        self.counters["recomputed_rows"] += len(seqs)

    def memory_held(self) -> dict[str, int]:
        """Bytes this engine holds now: ``weights`` (parameters and buffers, wherever they are)
        and ``kv_cache`` (the running batch's cache buffers, kept between steps for reuse)."""
        weights = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        chunked = ([t for t in self._chunked.cache.keys + self._chunked.cache.values if t is not None]
                   if self._chunked is not None else [])
        kv = self._cache.nbytes + sum(t.numel() * t.element_size() for t in chunked)
        return {"weights": weights, "kv_cache": kv}

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
        self._cache.release()
        self._out_tok = self._out_tok.new_zeros((0, 0))
        self._out_lp = self._out_lp.new_zeros((0, 0))
        if self.device.type != "cpu":
            self.model.to("cpu")
            self._vhash = self._vhash.cpu()
            getattr(torch, self.device.type).empty_cache()
        self._released = True

    def resume_memory(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
            self._vhash = self._vhash.to(self.device)
        self._released = False

    def _check_ids(self, ids: tuple[int, ...], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad} outside the vocab [0, {self.vocab_size})")
