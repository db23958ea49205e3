"""The engine's grouped-query attention computes what transformers' eager attention does."""
from __future__ import annotations

import pytest
import torch

from asyncflow.engines.rollout.attention import grouped_attention


@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_attention_matches_eager(q_len):
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward
    torch.manual_seed(0)
    b, heads, kv_heads, k_len, d = 3, 8, 2, 11, 16
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    module.training = False
    query = torch.randn(b, q_len, heads, d).transpose(1, 2)  # strided, as the layers pass it
    cache = torch.randn(b, kv_heads, 20, d)  # a cache buffer with room to spare: keys are a slice
    key, value = cache[:, :, :k_len], torch.randn(b, kv_heads, 20, d)[:, :, :k_len]
    mask = torch.zeros(b, 1, q_len, k_len + 4)  # wider than the keys, as a prepared mask may be
    mask[0, :, :, 7:] = torch.finfo(torch.float32).min
    mask[2, :, :, :2] = torch.finfo(torch.float32).min
    got, _ = grouped_attention(module, query, key, value, mask, scaling=d ** -0.5)
    want, _ = eager_attention_forward(module, query, key, value, mask[:, :, :, :k_len], scaling=d ** -0.5)
    assert got.shape == want.shape == (b, q_len, heads, d)
    assert torch.allclose(got, want, atol=1e-6)
