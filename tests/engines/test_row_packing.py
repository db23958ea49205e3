"""row_packing.pack_rows: every sequence once, rows never past max(row_tokens, longest), and
little padding when the rows are brought to one width."""
from __future__ import annotations

import random

import pytest

from asyncflow.engines.row_packing import pack_rows


def _slots(lengths: list[int], row_tokens: int) -> tuple[int, int]:
    """(rows x widest row, widest row) of the packing."""
    rows = pack_rows(lengths, row_tokens)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    width = max(sum(lengths[i] for i in r) for r in rows)
    return len(rows) * width, width


def test_one_row_keeps_the_order_given():
    assert pack_rows([5, 9, 3, 7], 0) == [[0, 1, 2, 3]]  # row_tokens <= 0: one row
    assert pack_rows([5, 9, 3, 7], 100) == [[0, 1, 2, 3]]  # everything fits one row
    assert pack_rows([], 64) == []


def test_rows_are_dealt_even_when_a_remainder_would_pad_the_rest():
    assert pack_rows([5, 9, 3, 7], 12) == [[1, 2], [3, 0]]  # 9+3 | 7+5
    # first fit: 4 x 26 | 2 x 26, every row padded to 104; dealt: 3 x 26 | 3 x 26
    assert _slots([26] * 6, 128) == (156, 78)


@pytest.mark.parametrize("lengths, row_tokens, most_slots", [
    ([4000] + [100] * 40, 64, 8000),  # one long sequence and many short: two rows of 4000
    ([110] * 18, 128, 1980),  # just under the row size: one each, no padding
    ([1000] + [60] * 16, 128, 2000),  # the long one alone, the short ones together
])
def test_width_never_passes_the_capacity_and_padding_stays_small(lengths, row_tokens, most_slots):
    slots, width = _slots(lengths, row_tokens)
    assert width <= max(row_tokens, max(lengths))
    assert slots <= most_slots


def test_random_batches_pad_little():
    rng = random.Random(0)
    for n, lo, hi, row_tokens in [(8, 5, 32, 128), (64, 8, 32, 128), (64, 200, 2000, 128), (300, 3, 40, 64)]:
        lengths = [rng.randint(lo, hi) for _ in range(n)]
        slots, width = _slots(lengths, row_tokens)
        assert width <= max(row_tokens, max(lengths))
        assert slots <= 1.15 * sum(lengths), (n, lo, hi, slots, sum(lengths))
