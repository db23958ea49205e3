"""The built-in engine's attention: grouped-query attention without copying keys and values.

transformers' eager attention repeats every key/value head for the query heads that share
it (``repeat_kv``): a copy of the whole cache slice per layer per decode step, which on a
small model is a large share of the step. Here the query heads that share a key/value head
are folded into the query-length dimension, so one batched matmul per kv head reads the
cache in place. Same math as eager (additive float masks, softmax in float32).
"""
from __future__ import annotations

import torch

__all__ = ["GROUPED", "use_grouped_attention"]

GROUPED = "asyncflow_grouped"


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [b, heads, q, d]; key/value [b, kv_heads, k, d]; mask additive [b, 1, q, >= k].
    Returns [b, q, heads, d] as transformers' attention functions do (no weights)."""
    b, h, q, d = query.shape
    kvh = key.shape[1]
    g = h // kvh  # query head i reads kv head i // g (repeat_kv's order)
    scores = torch.matmul(query.reshape(b, kvh, g * q, d), key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        k = scores.shape[-1]
        scores = (scores.view(b, kvh, g, q, k) + attention_mask[:, :, None, :, :k]).view(b, kvh, g * q, k)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).view(b, h, q, d).transpose(1, 2).contiguous()
    return out, None


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Switch a model the engine owns to ``grouped_attention`` (masks built as for eager, so
    transformers' own generate/forward on it stays correct)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if GROUPED not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED, grouped_attention)
    if GROUPED not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(GROUPED, eager_mask)
    set_implementation = getattr(model, "set_attn_implementation", None)
    if not callable(set_implementation):
        raise TypeError(f"{type(model).__name__} is not a Hugging Face model (no set_attn_implementation); "
                        "the built-in engine runs transformers' causal LMs")
    set_implementation(GROUPED)
