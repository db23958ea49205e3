"""The built-in engine's model runner: forward passes of a Hugging Face decoder over the engine's caches.

It owns the model's compute, never the schedule: a decode step over the running batch's
``SlotKVCache``, prompts prefilled packed end to end (no padding) and once per distinct
prompt (a GRPO group shares one) into a ``PrefillCache``, a long prompt's chunk, and the LM
head on the positions the engine samples from. Masks are built here (HF models accept a
prepared mask dict) and attention reads the cache without copying it (``attention.py``).
Which rows run, and when, is the scheduler's (``builtin.py``).
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from asyncflow.engines.rollout.attention import GROUPED, use_grouped_attention
from asyncflow.engines.rollout.slot_cache import PrefillCache, SlotKVCache
from asyncflow.engines.row_packing import pack_rows

__all__ = ["PACK_WIDTH", "ModelRunner", "Place", "Prefilled", "cache_keyword"]

# Config attributes that make a model's logits more than `lm_head(hidden)`; the engine
# computes logits itself, so it refuses such models rather than sample from wrong ones.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# Prefill packs prompts into rows of at most this many tokens (or the longest prompt):
# attention inside a packed row costs width^2, padding rows to one width costs whole tokens.
PACK_WIDTH = 128

# Where a prefilled sequence's keys and values lie: (staging cache, row, offset in the row).
Place = tuple[PrefillCache, int, int]


class Prefilled(NamedTuple):
    """A prefill's result: each sequence's last hidden state (in the order given), its place,
    and how many sequences shared another's computation (identical prompts)."""
    hidden: torch.Tensor
    places: list[Place]
    shared: int


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


def _submodule(model: torch.nn.Module, name: str | None, what: str) -> torch.nn.Module:
    part = getattr(model, name, None) if name else None
    if not isinstance(part, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no {what} to call separately (got {type(part).__name__})")
    return part


def _weight(module: torch.nn.Module, what: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"BuiltinRolloutEngine: the {what} ({type(module).__name__}) has no weight tensor")
    return weight


def check_model(config: Any) -> None:
    """Raise for a model whose config the runner cannot run correctly (attention, layers, logits)."""
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("eager", "sdpa", GROUPED):  # GROUPED: a model another engine took over before
        raise ValueError(f"BuiltinRolloutEngine needs attn_implementation 'eager' or 'sdpa' "
                         f"(it passes additive float masks), the model has {attn!r}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError("BuiltinRolloutEngine supports full attention layers only, the model has "
                         f"{sorted(layer_types)}")
    for name in _HEAD_MODIFIERS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"BuiltinRolloutEngine computes logits as lm_head(hidden); the model sets "
                             f"config.{name}={getattr(config, name)!r}, which it does not apply")


class ModelRunner:
    """Forward passes of ``model`` (moved to ``device``, in eval mode) on caches the caller owns."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str | None, pad_token_id: int) -> None:
        config: Any = getattr(model, "config", None)
        check_model(config)
        # Both take additive float masks, as the engine builds them; the engine then runs the model
        # with its own grouped-query attention (same math, no copy of the cache per step).
        use_grouped_attention(model)
        self.model = model
        self.base = _submodule(model, getattr(model, "base_model_prefix", None), "base model")  # no LM head
        self.cache_kw = cache_keyword(self.base)
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, torch.nn.Module):
            raise ValueError(f"{type(model).__name__} has no output embeddings to call separately")
        self.head = head
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self.device).eval()
        self.num_layers = int(config.num_hidden_layers)
        head_weight = _weight(head, "output embeddings")
        self.vocab_size = int(head_weight.shape[0])
        self.dtype = head_weight.dtype
        self.pad_token_id = int(pad_token_id)
        self._neg = torch.finfo(self.dtype).min

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [rows, hidden], in float32."""
        return self.head(hidden).float()

    def decode(self, pending: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Feed each running row its pending token; return the hidden states [rows, hidden]."""
        width = cache.begin_decode()
        lens = cache.row_lens
        mask = torch.zeros((cache.n, 1, 1, width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(torch.arange(width, device=self.device)[None, None, None, :] > lens[:, None, None, None],
                          self._neg)
        hidden = self._forward(pending[:, None], mask, lens[:, None], cache)
        cache.end_decode()
        return hidden

    def prefill(self, seqs: list[torch.Tensor]) -> Prefilled:
        """Prefill sequences in one forward; each one's last hidden state and place.
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
            hidden, places = self._prefill_packed(seqs)
            return Prefilled(hidden, places, 0)
        hidden, places = self._prefill_packed(unique)
        return Prefilled(hidden[torch.tensor(of, device=hidden.device)], [places[o] for o in of],
                         len(seqs) - len(unique))

    def _prefill_packed(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, list[Place]]:
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
        mask = torch.zeros((rows, 1, width, width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], self._neg)
        cache = PrefillCache(self.num_layers, rows, width)
        out = self._run_base(ids.to(self.device), mask, positions.to(self.device), cache)
        last = torch.tensor([r * width + off + n - 1 for (r, off), n in zip(where, lens)], device=self.device)
        return out.reshape(rows * width, -1)[last], [(cache, r, off) for r, off in where]

    def prefill_span(self, prompt: torch.Tensor, start: int, end: int, cache: PrefillCache) -> torch.Tensor:
        """Prefill prompt[start:end] of one long prompt into ``cache`` (which holds [0, start));
        the span's last hidden state [1, hidden]."""
        q = end - start
        ids = prompt[start:end].to(self.device, torch.int64)[None]
        mask = self._causal(q, start, 1)
        positions = torch.arange(start, end, device=self.device)[None]
        cache.offset = start
        return self._run_base(ids, mask, positions, cache)[:, -1]

    def _causal(self, q: int, offset: int, rows: int) -> torch.Tensor:
        """Additive mask [rows, 1, q, offset + q]: query i (at position offset + i) sees keys <= it."""
        keys = torch.arange(offset + q, device=self.device)
        queries = torch.arange(offset, offset + q, device=self.device)
        mask = torch.zeros((q, offset + q), dtype=self.dtype, device=self.device)
        mask.masked_fill_(keys[None, :] > queries[:, None], self._neg)
        return mask[None, None].expand(rows, 1, q, offset + q)

    def _run_base(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                  cache: PrefillCache | SlotKVCache) -> torch.Tensor:
        """Run the decoder stack on our cache and mask; the hidden states [rows, q, hidden]."""
        out = self.base(input_ids=ids, attention_mask={"full_attention": mask}, position_ids=positions,
                        use_cache=True, **{self.cache_kw: cache})
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: PrefillCache | SlotKVCache) -> torch.Tensor:
        """Run the decoder stack; return the last position's hidden state [rows, hidden]."""
        return self._run_base(ids, mask, positions, cache)[:, -1]
