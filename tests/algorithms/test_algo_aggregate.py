"""Masked reductions and loss aggregation, including the micro-batch / DP-shard identity."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import (
    AGGREGATIONS,
    aggregate,
    count_seqs,
    count_tokens,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

# Two sequences: [1, 2, 3] (3 real tokens) and [4] (1 real token, then padding).
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_hand_computed_modes() -> None:
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert aggregate(X, M, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: (6 + 4) / 2 sequences = 5
    assert aggregate(X, M, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: (6/3 + 4/1) / 2 = 3
    assert aggregate(X, M, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # default mode is token-mean; bool masks behave like 0/1 masks
    assert aggregate(X, M.bool()).item() == pytest.approx(2.5)


def test_explicit_counts_divide_instead_of_local_counts() -> None:
    assert aggregate(X, M, "token-mean", num_tokens=10).item() == pytest.approx(1.0)  # 10 / 10
    assert aggregate(X, M, "seq-mean-token-sum", num_seqs=5).item() == pytest.approx(2.0)  # 10 / 5
    assert aggregate(X, M, "seq-mean-token-mean", num_seqs=4, num_tokens=1).item() == pytest.approx(1.5)  # 6 / 4
    assert aggregate(X, M, "token-mean", num_tokens=torch.tensor(8.0)).item() == pytest.approx(1.25)


@pytest.mark.parametrize("mode", MODES)
def test_padding_never_contributes(mode: str) -> None:
    x = X.clone()
    x[1, 1:] = torch.tensor([float("nan"), float("inf")])
    assert aggregate(x, M, mode).item() == pytest.approx(aggregate(X, M, mode).item())
    # an all-padding row counts neither as tokens nor as a sequence
    x2 = torch.cat([X, torch.full((1, 3), 7.0)])
    m2 = torch.cat([M, torch.zeros(1, 3, dtype=M.dtype)])
    assert aggregate(x2, m2, mode).item() == pytest.approx(aggregate(X, M, mode).item())


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_gives_zero_not_nan(mode: str) -> None:
    out = aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    # an empty global batch: the engine passes zero counts
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode, num_tokens=0, num_seqs=0).item() == 0.0


def _random_batch(gen: torch.Generator, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = 0  # include an all-padding row
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    x = torch.randn(b, t, generator=gen, dtype=torch.float64)
    x[~mask] = float("nan")  # padding must not leak in
    return x, mask


def _random_partition(gen: torch.Generator, idx: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split idx into `parts` contiguous pieces of random (possibly zero) sizes."""
    cuts = torch.sort(torch.randint(0, len(idx) + 1, (parts - 1,), generator=gen)).values.tolist()
    bounds = [0, *cuts, len(idx)]
    return [idx[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(5))
def test_micro_batches_and_dp_shards_with_global_counts_sum_to_full_batch(mode: str, seed: int) -> None:
    """The engine's contract: split a global batch over DP ranks and micro-batches, give every
    micro-batch the *global* counts, sum the results -> exactly the full-batch loss (and grads)."""
    gen = torch.Generator().manual_seed(seed)
    x, mask = _random_batch(gen, b=17, t=9)
    x.requires_grad_(True)
    full = aggregate(x, mask, mode)
    (g_full,) = torch.autograd.grad(full, x)

    # global counts, computed the way the engine would: summed over every piece of the batch
    num_tokens, num_seqs = count_tokens(mask), count_seqs(mask)
    perm = torch.randperm(x.shape[0], generator=gen)
    total = torch.zeros((), dtype=torch.float64)
    n_pieces = 0
    for shard in _random_partition(gen, perm, parts=3):  # DP ranks
        for micro in _random_partition(gen, shard, parts=int(torch.randint(1, 4, (1,), generator=gen))):
            if len(micro) == 0:
                continue
            total = total + aggregate(x[micro], mask[micro], mode, num_tokens=num_tokens, num_seqs=num_seqs)
            n_pieces += 1
    assert n_pieces > 1
    (g_split,) = torch.autograd.grad(total, x)
    assert_close(total, full, rtol=1e-12, atol=1e-12)
    assert_close(g_split, g_full, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert math.isfinite(full.item())


def test_local_means_of_micro_batches_do_not_sum_to_the_full_loss() -> None:
    """Why global counts exist: averaging per-micro-batch means weights tokens unevenly."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    full = aggregate(x, m, "token-mean")  # (4 + 5) / 5 = 1.8
    naive = (aggregate(x[:1], m[:1], "token-mean") + aggregate(x[1:], m[1:], "token-mean")) / 2  # (1 + 5) / 2 = 3
    assert full.item() == pytest.approx(1.8) and naive.item() == pytest.approx(3.0)


def test_masked_sum_mean_var_whiten_by_hand() -> None:
    v = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    m = torch.tensor([[1, 1], [1, 0]])
    assert masked_sum(v, m).item() == 6.0
    assert masked_mean(v, m).item() == 2.0
    # population variance of {1, 2, 3} = ((1)^2 + 0 + (1)^2) / 3 = 2/3; unbiased: 2/2 = 1
    assert masked_var(v, m).item() == pytest.approx(2 / 3)
    assert masked_var(v, m, unbiased=True).item() == pytest.approx(1.0)
    assert_close(masked_sum(v, m, dim=-1), torch.tensor([3.0, 3.0]))
    assert_close(masked_mean(v, m, dim=-1), torch.tensor([1.5, 3.0]))
    s = math.sqrt(2 / 3)
    w = masked_whiten(v, m, eps=0.0)
    assert_close(w, torch.tensor([[-1 / s, 0.0], [1 / s, 0.0]]))
    # shift_mean=False rescales but keeps the mean: (x - 2)/s + 2
    w2 = masked_whiten(v, m, shift_mean=False, eps=0.0)
    assert_close(w2, torch.tensor([[-1 / s + 2, 2.0], [1 / s + 2, 0.0]]))
    # unbiased (verl's masked_whiten): std 1
    assert_close(masked_whiten(v, m, eps=0.0, unbiased=True), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.1, 1 / 3, 1e7 + 0.1, -2.7])
@pytest.mark.parametrize("unbiased", [False, True])
def test_masked_whiten_of_equal_entries_is_exactly_zero(dtype: torch.dtype, value: float, unbiased: bool) -> None:
    # padding first and holding garbage: the reference entry is the first *valid* one
    v = torch.full((3, 5), value, dtype=dtype)
    v[0, 0] = float("nan")
    m = torch.ones(3, 5, dtype=torch.bool)
    m[0, 0] = False
    assert (masked_whiten(v, m, unbiased=unbiased) == 0).all()
    kept = masked_whiten(v, m, shift_mean=False, unbiased=unbiased)
    assert (kept[m] == v[m]).all() and kept[0, 0] == 0


def test_masked_mean_of_empty_row_is_zero() -> None:
    v = torch.tensor([[1.0, 2.0], [float("nan"), 5.0]])
    m = torch.tensor([[1, 1], [0, 0]])
    assert_close(masked_mean(v, m, dim=-1), torch.tensor([1.5, 0.0]))


def test_counts() -> None:
    assert count_tokens(M) == 4 and count_seqs(M) == 2
    assert count_seqs(torch.zeros(3, 2)) == 0


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but per_token has shape \(2, 3\)"):
        aggregate(X, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"per_token must be a \[B, T\] tensor"):
        aggregate(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        aggregate(X, M, "token-mean", num_tokens=-1)
    with pytest.raises(ValueError, match="num_seqs must be >= 0"):
        aggregate(X, M, "seq-mean-token-mean", num_seqs=-1)
    with pytest.raises(ValueError, match="registered: seq-mean-token-mean, seq-mean-token-sum, token-mean"):
        aggregate(X, M, "sum")


def test_registry_functions_share_signature() -> None:
    for name in AGGREGATIONS.names():
        out = AGGREGATIONS.get(name)(X, M, num_tokens=None, num_seqs=None)
        assert out.shape == ()
