"""BatchMeta.part: one data-parallel rank's share, the same rows as chunk()[i] without building the others."""
import pytest

from asyncflow.transfer_queue.meta import BatchMeta


def _meta(n: int, dp_parts: list[int] | None = None) -> BatchMeta:
    return BatchMeta("p", list(range(100, 100 + n)), ["x"], groups=[i // 4 for i in range(n)],
                     tokens=[i + 1 for i in range(n)], dp_parts=dp_parts or [],
                     locations={"x": [i % 3 for i in range(n)]})


@pytest.mark.parametrize("n,parts,dp_parts", [(10, 3, None), (3, 5, None), (12, [5, 0, 7], None),
                                                (12, 3, [5, 0, 7])])
def test_part_is_chunk_entry(n, parts, dp_parts):
    if isinstance(parts, list):  # dp_parts of another split size are ignored: equal split
        meta, parts = _meta(n, parts), 2
    else:
        meta = _meta(n, dp_parts)
    whole = meta.chunk(parts)
    assert [meta.part(parts, i) for i in range(parts)] == whole
    assert meta.part_sizes(parts) == [len(w) for w in whole]
    assert sum(meta.part_sizes(parts)) == n


def test_part_follows_sampler_split():
    meta = _meta(12, [5, 0, 7])
    assert meta.part(3, 1).rows == []
    assert meta.part(3, 2).rows == list(range(105, 112 + 0))
    assert meta.part(3, 2).tokens == list(range(6, 13))


def test_part_out_of_range_names_it():
    with pytest.raises(IndexError, match="part 3 of a batch split into 3"):
        _meta(6).part(3, 3)
    with pytest.raises(ValueError, match="into 0 parts"):
        _meta(6).part(0, 0)
