"""Entropy from logits: exact values, stability, masked vocabulary."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import entropy_from_logits


def test_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0],  # uniform over 4: log 4 = 1.386294
                           [1e4, 0.0, 0.0, 0.0],  # all mass on one token: 0 (and no overflow)
                           [0.0, 0.0, float("-inf"), float("-inf")]])  # masked vocab: uniform over 2 = log 2
    out = entropy_from_logits(logits)
    assert_close(out, torch.tensor([math.log(4), 0.0, math.log(2)]))


def test_matches_categorical_and_keeps_leading_shape() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen) * 3
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3)
    assert_close(out, torch.distributions.Categorical(logits=logits).entropy())


def test_gradient_finite_with_masked_vocab_and_half_precision_upcast() -> None:
    logits = torch.tensor([[1.0, 2.0, float("-inf")]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0
    out = entropy_from_logits(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert_close(out, torch.full((2,), math.log(8)))


def test_errors() -> None:
    with pytest.raises(ValueError, match="floating point"):
        entropy_from_logits(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must be a tensor \[..., V\]"):
        entropy_from_logits(torch.tensor(1.0))
