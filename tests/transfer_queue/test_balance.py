"""Tests for token-balanced DP partitioning (asyncflow.transfer_queue.balance)."""

from __future__ import annotations

import random
import statistics

import pytest

from asyncflow.transfer_queue.balance import (
    contiguous_partition,
    greedy_partition,
    imbalance,
    karmarkar_karp,
)

SEEDS = range(10)


def long_tail_lengths(seed: int, n: int = 256) -> list[int]:
    """Lognormal response lengths (median ~400 tokens, long tail capped at 16k)."""
    rng = random.Random(seed)
    return [min(int(rng.lognormvariate(6.0, 1.0)) + 1, 16384) for _ in range(n)]


def sums(lengths: list[int], parts: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in part) for part in parts]


def assert_partition(parts: list[list[int]], n: int, k: int, equal_size: bool) -> None:
    assert len(parts) == k
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n)), "every index must appear exactly once"
    for part in parts:
        assert part == sorted(part)
    if equal_size:
        assert all(len(part) == n // k for part in parts)


# --- hand-checked cases -------------------------------------------------------


def test_kk_unequal_hand_case_is_perfect():
    lengths = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(lengths, 2, equal_size=False)
    assert_partition(parts, 5, 2, equal_size=False)
    assert sorted(sums(lengths, parts)) == [15, 15]
    assert imbalance(lengths, parts) == 1.0


def test_plain_kk_is_the_classic_differencing_result():
    # Textbook LDM on {8,7,6,5,4}: 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> sums 16/14.
    # The refinement pass is what turns this into the optimal 15/15.
    lengths = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(lengths, 2, equal_size=False, refine=False)
    assert_partition(parts, 5, 2, equal_size=False)
    assert sorted(sums(lengths, parts)) == [14, 16]


@pytest.mark.parametrize("refine", [True, False])
def test_kk_equal_size_hand_cases(refine):
    # Pairs (8,3), (7,4), (6,5) all sum to 11.
    lengths = [8, 7, 6, 5, 4, 3]
    parts = karmarkar_karp(lengths, 3, refine=refine)
    assert_partition(parts, 6, 3, equal_size=True)
    assert sums(lengths, parts) == [11, 11, 11]

    # Total 21 in two triples: 11/10 is the best possible.
    lengths = [1, 2, 3, 4, 5, 6]
    parts = karmarkar_karp(lengths, 2, refine=refine)
    assert_partition(parts, 6, 2, equal_size=True)
    assert sorted(sums(lengths, parts)) == [10, 11]


def test_kk_parts_ordered_by_descending_sum():
    lengths = [1, 2, 3, 4, 5, 6]
    parts = karmarkar_karp(lengths, 2)
    assert sums(lengths, parts) == sorted(sums(lengths, parts), reverse=True)


def test_equal_size_cannot_pair_outlier_with_short_rows_without_refine():
    # One huge row: the balanced answer puts it with the shortest rows, which
    # plain equal-size KK (one row per length-sorted group of k) cannot do.
    lengths = long_tail_lengths(0)
    lengths[0] = 16384
    plain = imbalance(lengths, karmarkar_karp(lengths, 4, refine=False))
    refined_parts = karmarkar_karp(lengths, 4)
    assert_partition(refined_parts, 256, 4, equal_size=True)
    refined = imbalance(lengths, refined_parts)
    assert plain > 1.05
    assert refined < 1.01


# --- edge cases ---------------------------------------------------------------


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition])
def test_k_equals_one(fn):
    assert fn([3, 1, 2], 1) == [[0, 1, 2]]
    assert fn([3, 1, 2], 1, equal_size=False) == [[0, 1, 2]]


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition])
@pytest.mark.parametrize("equal_size", [True, False])
def test_empty_input(fn, equal_size):
    assert fn([], 3, equal_size=equal_size) == [[], [], []]


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition])
def test_more_parts_than_rows_when_not_equal_size(fn):
    lengths = [5, 1]
    parts = fn(lengths, 4, equal_size=False)
    assert_partition(parts, 2, 4, equal_size=False)
    assert sorted(sums(lengths, parts)) == [0, 0, 1, 5]


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition])
def test_all_zero_lengths(fn):
    parts = fn([0] * 8, 4)
    assert_partition(parts, 8, 4, equal_size=True)
    assert imbalance([0] * 8, parts) == 1.0


def test_deterministic():
    lengths = long_tail_lengths(3)
    assert karmarkar_karp(lengths, 8) == karmarkar_karp(list(lengths), 8)
    unequal = karmarkar_karp(lengths, 8, equal_size=False)
    assert unequal == karmarkar_karp(lengths, 8, equal_size=False)


def test_accepts_integer_like_scalars():
    np = pytest.importorskip("numpy")
    lengths = np.array([8, 7, 6, 5, 4, 3], dtype=np.int64)
    parts = karmarkar_karp(lengths, 3)
    assert sums([int(x) for x in lengths], parts) == [11, 11, 11]


def test_contiguous_partition():
    assert contiguous_partition([1] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    # Not divisible: first len % k chunks get one extra row.
    assert contiguous_partition([1] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert contiguous_partition([], 2) == [[], []]


def test_imbalance():
    assert imbalance([4, 4, 2, 6], [[0, 1], [2, 3]]) == 1.0
    assert imbalance([6, 2], [[0], [1]]) == pytest.approx(6 / 4)
    assert imbalance([5], [[0], []]) == 2.0
    assert imbalance([0, 0], [[0], [1]]) == 1.0


# --- properties on long-tailed random batches ---------------------------------


@pytest.mark.parametrize("k", [4, 8])
@pytest.mark.parametrize("equal_size", [True, False])
def test_every_index_once_on_random_batches(k, equal_size):
    for seed in SEEDS:
        lengths = long_tail_lengths(seed)
        for fn in (karmarkar_karp, greedy_partition):
            assert_partition(fn(lengths, k, equal_size=equal_size), 256, k, equal_size)
        assert_partition(karmarkar_karp(lengths, k, equal_size, refine=False), 256, k, equal_size)
        assert_partition(contiguous_partition(lengths, k), 256, k, equal_size=True)


@pytest.mark.parametrize("k, bound", [(4, 1.02), (8, 1.02)])
@pytest.mark.parametrize("equal_size", [True, False])
def test_kk_balances_long_tail(k, bound, equal_size):
    kk_scores, greedy_scores = [], []
    for seed in SEEDS:
        lengths = long_tail_lengths(seed)
        kk = imbalance(lengths, karmarkar_karp(lengths, k, equal_size=equal_size))
        naive = imbalance(lengths, contiguous_partition(lengths, k))
        assert kk <= naive
        assert kk < bound, f"seed {seed}: imbalance {kk:.4f}"
        kk_scores.append(kk)
        greedy = greedy_partition(lengths, k, equal_size=equal_size)
        greedy_scores.append(imbalance(lengths, greedy))
    assert statistics.mean(kk_scores) <= statistics.mean(greedy_scores)
    # Sanity check that the workload is actually skewed without balancing.
    naive_scores = []
    for seed in SEEDS:
        lengths = long_tail_lengths(seed)
        naive_scores.append(imbalance(lengths, contiguous_partition(lengths, k)))
    assert statistics.mean(naive_scores) > 1.1


def test_greedy_respects_capacity_and_beats_contiguous():
    for seed in SEEDS:
        lengths = long_tail_lengths(seed)
        parts = greedy_partition(lengths, 4)
        assert_partition(parts, 256, 4, equal_size=True)
        assert imbalance(lengths, parts) <= imbalance(lengths, contiguous_partition(lengths, 4))


# --- bad inputs ---------------------------------------------------------------


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition])
def test_not_divisible_raises_helpful_error(fn):
    pattern = r"cannot split 10 rows into 4 equal parts.*multiple of the data-parallel size"
    with pytest.raises(ValueError, match=pattern):
        fn([1] * 10, 4)
    # The same input is fine when equal sizes are not required.
    assert_partition(fn([1] * 10, 4, equal_size=False), 10, 4, equal_size=False)


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition, contiguous_partition])
@pytest.mark.parametrize("k", [0, -1, 2.0, "2", True, None])
def test_bad_k_raises(fn, k):
    with pytest.raises(ValueError, match=r"k must be"):
        fn([1, 2], k)


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition, contiguous_partition])
@pytest.mark.parametrize(
    "bad, pattern",
    [
        (-3, r"lengths\[1\] must be a non-negative token count, got -3"),
        (2.5, r"lengths\[1\] must be a non-negative integer token count.*float"),
        ("7", r"lengths\[1\] must be a non-negative integer token count.*str"),
        (None, r"lengths\[1\] must be a non-negative integer token count"),
    ],
)
def test_bad_lengths_raise(fn, bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn([1, bad], 2)


def test_imbalance_rejects_no_parts():
    with pytest.raises(ValueError, match=r"at least one part"):
        imbalance([1, 2], [])
