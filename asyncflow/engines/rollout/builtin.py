"""The built-in rollout engine: batched KV-cache decoding of a Hugging Face causal LM.

Made for CPU (it is AsyncFlow's default engine on a laptop) and correct on any device.
What makes it faster than `model.generate` on the same model:
- finished rows leave the batch (KV cache, masks, positions and keys shrink), so the
  compute follows the rows still generating instead of the longest one;
- the KV cache is preallocated and written in place (`RowKVCache`), no torch.cat per step;
- the attention masks are built by the engine once per generate and sliced per step
  (HF models accept an already prepared mask dict), skipping transformers' mask
  construction on every forward;
- only the last position's hidden state goes through the LM head;
- sampling is a handful of whole-batch tensor ops (`sampling.sample_step`).
Prompts are left padded so that all rows write the same cache position each step;
position ids count real tokens only, so padding never changes a row's result.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch

from asyncflow.engines.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, check_generate_args
from asyncflow.engines.rollout.kv_cache import RowKVCache
from asyncflow.engines.rollout.sampling import SeedKeys, sample_step, vocab_hash

__all__ = ["BuiltinRolloutEngine"]

# Config attributes that make a model's logits more than `lm_head(hidden)`; the engine
# computes logits itself, so it refuses such models rather than sample from wrong ones.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class BuiltinRolloutEngine(RolloutEngine):
    """Rollout engine over an in-process Hugging Face causal LM (Qwen2, Llama-style decoders).

    The engine takes the model over: it moves it to `device`, puts it in eval mode and
    updates its weights in place in `load_weights`.
    """

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: list[int], pad_token_id: int,
                 device: torch.device | str | None = None) -> None:
        cfg = model.config
        attn = getattr(cfg, "_attn_implementation", None)
        if attn not in ("eager", "sdpa"):
            raise ValueError(f"BuiltinRolloutEngine needs attn_implementation 'eager' or 'sdpa' "
                             f"(it passes additive float masks), the model has {attn!r}")
        layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"BuiltinRolloutEngine supports full attention layers only, the model has {sorted(layer_types)}")
        for name in _HEAD_MODIFIERS:
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                raise ValueError(f"BuiltinRolloutEngine computes logits as lm_head(hidden); the model sets "
                                 f"config.{name}={getattr(cfg, name)!r}, which it does not apply")
        self.model = model
        self.base = getattr(model, model.base_model_prefix)  # the decoder stack without the LM head
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
        self.version = 0
        self._released = False
        self._vhash = vocab_hash(self.vocab_size, self.device)
        # The KV caches of generations running now (one per generate call, dropped when it
        # returns): weak, so that counting them for memory_held() never keeps one alive.
        self._live_caches: weakref.WeakSet[RowKVCache] = weakref.WeakSet()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, *, seeds: list[int],
                 max_new_tokens: list[int] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> GenerationOutput:
        budgets = check_generate_args(prompts, params, seeds, max_new_tokens)
        if self._released:
            raise RuntimeError("BuiltinRolloutEngine.generate after release_memory(): call resume_memory() first")
        self._check_ids(params.stop_token_ids, "SamplingParams.stop_token_ids")
        for i, p in enumerate(prompts):
            lo, hi = int(p.min()), int(p.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"generate: prompt {i} has token ids in [{lo}, {hi}], outside the vocab [0, {self.vocab_size})")
        with torch.inference_mode():
            return self._generate(prompts, params, seeds, budgets, should_abort)

    def _generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int], budgets: list[int],
                  should_abort: Callable[[], bool] | None) -> GenerationOutput:
        n = len(prompts)
        lengths = [0] * n
        reasons = ["length"] * n
        rows = [i for i in range(n) if budgets[i] > 0]  # a zero budget is already finished
        if rows and should_abort is not None and should_abort():
            for i in rows:
                reasons[i] = "abort"
            rows = []
        tokens_buf = lp_buf = None
        if rows:
            tokens_buf, lp_buf = self._decode(rows, prompts, params, seeds, budgets, should_abort, lengths, reasons)
        buf_row = {r: j for j, r in enumerate(rows)}  # prompt index -> row of the decode buffers
        responses, log_probs = [], []
        for i in range(n):
            if lengths[i] == 0:
                responses.append(torch.empty(0, dtype=torch.int64))
                log_probs.append(torch.empty(0, dtype=torch.float32))
            else:
                j = buf_row[i]
                responses.append(tokens_buf[j, :lengths[i]].clone())
                log_probs.append(lp_buf[j, :lengths[i]].clone())
        return GenerationOutput(responses, log_probs, reasons)

    def _decode(self, rows: list[int], prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int],
                budgets: list[int], should_abort: Callable[[], bool] | None, lengths: list[int], reasons: list[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the rows with a positive budget; fill lengths/reasons; return CPU token and log-prob buffers
        (one buffer row per entry of `rows`)."""
        dev = self.device
        # Rows sorted by prompt length (stable), so that prefill chunks of neighbouring rows
        # carry little padding. `rows` is rebound: buffer row j holds prompt rows[j].
        rows[:] = sorted(rows, key=lambda r: prompts[r].numel())
        a = len(rows)
        plens = torch.tensor([prompts[r].numel() for r in rows], dtype=torch.int64)
        p_max = int(plens[-1])
        budget = torch.tensor([budgets[r] for r in rows], dtype=torch.int64)
        n_max = int(budget.max())
        capacity = p_max + n_max

        # Left padding to a common right edge: row j's prompt occupies [p_max - len_j, p_max).
        valid = torch.zeros((a, capacity), dtype=torch.bool)
        valid[:, p_max:] = True  # generated tokens are always attended to
        for j in range(a):
            valid[j, p_max - int(plens[j]):p_max] = True
        dtype = self.head.weight.dtype
        neg = torch.finfo(dtype).min
        # Additive mask over all cache positions: 0 where attended, dtype-min where padding.
        pad_bias = torch.zeros((a, capacity), dtype=dtype).masked_fill_(~valid, neg).to(dev)
        next_pos = plens.to(dev)  # position of the first generated token of each row
        cache = RowKVCache(self.num_layers, capacity)
        cache.allocate_rows(a)
        self._live_caches.add(cache)
        hidden = self._prefill(rows, prompts, plens, p_max, valid, cache)

        is_stop = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
        is_stop[list(self.eos_token_ids) + list(params.stop_token_ids)] = True
        keys = None if params.greedy else SeedKeys([seeds[r] for r in rows], dev)
        tokens_buf = torch.zeros((a, n_max), dtype=torch.int64, device=dev)
        lp_buf = torch.zeros((a, n_max), dtype=torch.float32, device=dev)
        active = torch.arange(a, device=dev)  # buffer row of each row still in the batch
        budget = budget.to(dev)
        step = 0
        while True:
            logits = self.head(hidden).float()
            tok, lp = sample_step(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                  keys=keys, step=step, vhash=self._vhash)
            tokens_buf[active, step] = tok
            lp_buf[active, step] = lp
            step += 1
            stopped = is_stop[tok]
            done = stopped | (budget <= step)
            n_done = int(done.sum())
            if n_done:
                done_rows = active[done].tolist()
                done_stop = stopped[done].tolist()
                for j, s in zip(done_rows, done_stop):
                    lengths[rows[j]] = step
                    reasons[rows[j]] = "stop" if s else "length"
                if n_done == active.numel():
                    break
                keep = (~done).nonzero().squeeze(1)
                # Finished rows leave the batch: every per-row tensor shrinks alike.
                cache.keep_rows(keep)
                active, tok, budget, next_pos, pad_bias = active[keep], tok[keep], budget[keep], next_pos[keep], pad_bias[keep]
                if keys is not None:
                    keys = keys.select(keep)
            if should_abort is not None and should_abort():
                for j in active.tolist():
                    lengths[rows[j]] = step
                    reasons[rows[j]] = "abort"
                break
            kv_len = p_max + step  # cache length once this step's token is written
            hidden = self._forward(tok[:, None], pad_bias[:, None, None, :kv_len], (next_pos + (step - 1))[:, None], cache)
        return tokens_buf.cpu(), lp_buf.cpu()

    def _prefill(self, rows: list[int], prompts: list[torch.Tensor], plens: torch.Tensor, p_max: int,
                 valid: torch.Tensor, cache: RowKVCache) -> torch.Tensor:
        """Run the prompts through the model in chunks of rows sorted by length, each padded only to
        its own longest prompt (padding is compute thrown away); return last hidden states [rows, hidden]."""
        a = len(rows)
        n_chunks = 1 if a < 16 else 4
        bounds = [round(i * a / n_chunks) for i in range(n_chunks + 1)]
        dtype = self.head.weight.dtype
        neg = torch.finfo(dtype).min
        outs = []
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            width = int(plens[r1 - 1])  # the longest prompt of the chunk (rows are sorted)
            off = p_max - width
            ids = torch.full((r1 - r0, width), self.pad_token_id, dtype=torch.int64)
            for j in range(r0, r1):
                ids[j - r0, width - int(plens[j]):] = prompts[rows[j]]
            v = valid[r0:r1, off:p_max]
            causal = torch.ones((width, width), dtype=torch.bool).tril_()
            mask = torch.zeros((r1 - r0, 1, width, width), dtype=dtype).masked_fill_(
                ~(causal[None, None] & v[:, None, None, :]), neg)
            # Position ids count real tokens; padded slots get 0 (they are masked anyway).
            positions = (v.cumsum(1) - 1).clamp_(min=0)
            cache.prefill_target(r0, r1, off)
            outs.append(self._forward(ids.to(self.device), mask.to(self.device), positions.to(self.device), cache))
        cache.end_prefill(p_max)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: RowKVCache) -> torch.Tensor:
        """Run the decoder stack; return the last position's hidden state [rows, hidden]."""
        out = self.base(input_ids=ids, attention_mask={"full_attention": mask}, position_ids=positions,
                        cache=cache, use_cache=True)
        return out.last_hidden_state[:, -1]

    # ---- weights and memory -------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        target = self.model.state_dict()
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
        # Tied weights (embeddings / LM head) are one tensor under two names: either name will do.
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for k, t in target.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(k)
        missing = sorted(names[0] for names in groups.values() if not any(n in state_dict for n in names))
        if missing:
            raise KeyError(f"load_weights: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                           f"({len(missing)} in all; a full state_dict is required)")
        with torch.no_grad():
            for k, v in state_dict.items():
                target[k].copy_(v)  # in place: converts dtype and device as needed
        self.version = int(version)

    def memory_held(self) -> dict[str, int]:
        """Bytes this engine holds now: ``weights`` (parameters and buffers, wherever they are)
        and ``kv_cache`` (the KV buffers of generations in progress; 0 between generate calls)."""
        weights = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        return {"weights": weights, "kv_cache": sum(c.nbytes for c in list(self._live_caches))}

    def release_memory(self) -> None:
        """Give back what generation used, for a colocated trainer; weights are kept (load_weights
        works while released) and generate refuses to run until resume_memory().

        The KV cache and the other decode buffers exist only inside generate() (a RowKVCache per
        call), so between calls they are already freed, but to an allocator that keeps them.
        On an accelerator the caching allocator holds the freed blocks: the weights go to host
        memory and empty_cache returns every free block to the device. On the CPU the colocated
        roles share this process's heap, so what generation freed is already reused by the next
        role; returning it to the OS (malloc_trim) only made the next generate fault it back in
        (measured: 6% slower sync colocated GRPO steps), so nothing more is done there.
        """
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
