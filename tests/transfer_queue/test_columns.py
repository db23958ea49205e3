"""columns.py: take / concat / to_columns edge cases, without a service."""
from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncflow.rpc.codec import CodecError
from asyncflow.transfer_queue.columns import (
    FieldSchema,
    FixedColumn,
    JaggedColumn,
    ObjectColumn,
    column_from_wire,
    column_to_wire,
    concat,
    to_column,
    to_columns,
    to_tensordict,
)


def _jag(rows):
    return to_column("c", rows)


def _rows_of(col: JaggedColumn):
    return [col.row(i) for i in range(len(col))]


ROWS = [torch.arange(n) + 100 * n for n in (3, 0, 1, 5, 2)]
PER_TOKEN = [torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + n for n in (2, 1, 0, 3)]


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("idx", [[1, 2, 3], [0], [4], range(1, 4), [0, 1, 2, 3, 4]])
def test_take_of_contiguous_rows_is_a_view(idx):
    fixed = FixedColumn(torch.arange(20).reshape(5, 4))
    jag = _jag(ROWS)
    f, j = fixed.take(idx), jag.take(idx)
    assert torch.equal(f.data, fixed.data[list(idx)])
    assert _shares(f.data, fixed.data)
    assert [r.tolist() for r in _rows_of(j)] == [ROWS[i].tolist() for i in idx]
    assert _shares(j.values, jag.values)
    assert int(j.offsets[0]) == 0 and int(j.offsets[-1]) == j.values.shape[0]  # no stray values


@pytest.mark.parametrize("idx", [[3, 1], [4, 3, 2, 1, 0], [2, 2, 2], [0, 2, 4], [1, 3, 2, 4], [0, 1, 3]])
def test_take_in_any_order_with_repeats(idx):
    fixed = FixedColumn(torch.arange(20).reshape(5, 4))
    assert torch.equal(fixed.take(idx).data, fixed.data[idx])
    for rows in (ROWS, PER_TOKEN + [torch.ones(1, 4)]):
        j = _jag(rows).take(idx)
        assert len(j) == len(idx)
        assert j.values.shape[0] == sum(rows[i].shape[0] for i in idx)  # exactly the rows' values
        for got, i in zip(_rows_of(j), idx):
            assert torch.equal(got, rows[i])
    obj = ObjectColumn(["a", {"b": 1}, None, 3, [1]])
    assert obj.take(idx).items == [obj.items[i] for i in idx]


def test_take_of_no_rows_gives_an_empty_column_of_the_same_schema():
    for col in (FixedColumn(torch.zeros(3, 2)), _jag(PER_TOKEN), ObjectColumn(["x"])):
        e = col.take([])
        assert len(e) == 0 and e.schema == col.schema
    assert _jag(ROWS).take([]).offsets.tolist() == [0]


def test_take_of_a_taken_column_composes():
    j = _jag(ROWS)
    assert [r.tolist() for r in _rows_of(j.take([4, 3, 1]).take([2, 0]))] == [ROWS[1].tolist(), ROWS[4].tolist()]
    assert [r.tolist() for r in _rows_of(j.take([1, 2, 3]).take([2, 1]))] == [ROWS[3].tolist(), ROWS[2].tolist()]


def test_concat_of_jagged_pieces_rebases_offsets():
    j = _jag(ROWS)
    parts = [j.take([3, 4]), j.take([1]), j.take([0, 2])]
    out = concat(parts)
    assert out.offsets.tolist() == [0, 5, 7, 7, 10, 11]
    assert [r.tolist() for r in _rows_of(out)] == [ROWS[i].tolist() for i in (3, 4, 1, 0, 2)]
    pt = _jag(PER_TOKEN)
    out2 = concat([pt.take([3]), pt.take([2]), pt.take([0, 1])])
    assert out2.values.shape == (6, 4)
    for got, i in zip(_rows_of(out2), (3, 2, 0, 1)):
        assert torch.equal(got, PER_TOKEN[i])


def test_concat_of_fixed_and_object_columns_and_of_one_column():
    f = FixedColumn(torch.arange(6).reshape(3, 2))
    assert concat([f.take([2]), f.take([0, 1])]).data.tolist() == [[4, 5], [0, 1], [2, 3]]
    o = ObjectColumn(["a", "b"])
    assert concat([o, ObjectColumn([]), o.take([0])]).items == ["a", "b", "a"]
    assert concat([f]) is f


def test_schema_and_nbytes():
    j = _jag(PER_TOKEN)
    assert j.schema == FieldSchema("jagged", "float32", (4,))
    assert j.nbytes == 6 * 4 * 4 + 5 * 8  # values + offsets, no padding
    assert FixedColumn(torch.zeros(2, 3, dtype=torch.bfloat16)).schema.describe() == "fixed bfloat16[3]"
    assert FieldSchema.from_wire(j.schema.to_wire()) == j.schema
    assert ObjectColumn([1]).schema.describe() == "object"


# ---- to_column / to_columns ---------------------------------------------------------------

def test_to_columns_accepts_tensordict_with_nested_jagged_and_non_tensor_fields():
    nt = torch.nested.nested_tensor(ROWS, layout=torch.jagged)
    pt = torch.nested.nested_tensor(PER_TOKEN + [torch.zeros(2, 4)], layout=torch.jagged)
    td = TensorDict({"ids": nt, "pt": pt, "r": torch.arange(5.0), "s": NonTensorStack(*"abcde")}, batch_size=[5])
    cols, n = to_columns(td)
    assert n == 5
    assert isinstance(cols["ids"], JaggedColumn) and cols["ids"].values.shape == (11,)
    assert isinstance(cols["pt"], JaggedColumn) and cols["pt"].values.shape == (8, 4)
    assert isinstance(cols["r"], FixedColumn)
    assert cols["s"].items == list("abcde")
    back = to_tensordict(cols, n)
    for got, want in zip(back["ids"].unbind(), ROWS):
        assert torch.equal(got, want)


def test_nested_tensor_with_holes_is_gathered_without_the_holes():
    base = torch.arange(40).reshape(5, 8)
    lens = torch.tensor([3, 1, 8, 0, 2])
    nt = torch.nested.narrow(base, 1, torch.tensor([1, 0, 0, 4, 5]), lens, layout=torch.jagged)
    col = to_column("x", nt)
    assert col.values.shape[0] == int(lens.sum())
    for got, want in zip(_rows_of(col), nt.unbind()):
        assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_of_strided_layout_is_accepted():
    nt = torch.nested.nested_tensor(ROWS)  # strided layout
    col = to_column("x", nt)
    assert [r.tolist() for r in _rows_of(col)] == [r.tolist() for r in ROWS]


def test_to_column_keeps_column_objects_and_copies_tensors_to_cpu():
    f = FixedColumn(torch.zeros(2))
    assert to_column("x", f) is f
    assert to_columns({"x": f, "y": [1, 2]})[1] == 2


@pytest.mark.parametrize("data,err", [
    ({"a": torch.arange(3), "b": torch.arange(2)}, "different row counts"),
    ({"a": torch.tensor(1)}, "0-d tensor"),
    ({"a": [torch.arange(2), torch.arange(2.0)]}, "mixed dtypes"),
    ({"a": [torch.zeros(2, 3), torch.zeros(2, 4)]}, "shape \\[len, \\*same\\]"),
    ({"a": [torch.zeros(2), torch.tensor(1.0)]}, "shape \\[len, \\*same\\]"),
    ({"a": [torch.tensor(1.0), torch.zeros(2)]}, "shape \\[len, \\*same\\]"),  # the first row 0-d
    ({"a": [torch.zeros(2), torch.tensor(1)]}, "mixed dtypes"),  # the dtype is told before the shape
    ({"a": [torch.zeros(2), "x"]}, "mixes tensors and other values"),
    ({"a": {1, 2}}, "cannot store a set"),
    ({}, "no columns"),
])
def test_to_columns_refuses_data_it_cannot_store(data, err):
    with pytest.raises(ValueError, match=err):
        to_columns(data)


def test_to_columns_refuses_a_non_mapping():
    with pytest.raises(TypeError, match="TensorDict or a dict of columns"):
        to_columns([torch.zeros(2)])


def test_empty_list_is_an_object_column_of_zero_rows():
    cols, n = to_columns({"a": []})
    assert n == 0 and isinstance(cols["a"], ObjectColumn)


def test_zero_length_rows_are_kept():
    col = to_column("x", [torch.zeros(0), torch.ones(2), torch.zeros(0)])
    assert col.offsets.tolist() == [0, 0, 2, 2]
    assert col.take([2, 0]).offsets.tolist() == [0, 0, 0]


# ---- wire form -------------------------------------------------------------------------------

def test_wire_form_round_trips_every_kind():
    for col in (FixedColumn(torch.arange(4)), _jag(PER_TOKEN), ObjectColumn([{"a": 1}, "b"])):
        back = column_from_wire(column_to_wire(col))
        assert type(back) is type(col) and back.schema == col.schema and len(back) == len(col)


@pytest.mark.parametrize("wire", [
    {"k": "sparse", "data": torch.zeros(1)},
    {"k": "fixed"},
    {"k": "jagged", "values": torch.zeros(3)},
    {"k": "jagged", "values": torch.zeros(3), "offsets": torch.tensor([0, 3], dtype=torch.int32)},
    "fixed",
])
def test_malformed_wire_column_raises_codec_error(wire):
    with pytest.raises(CodecError):
        column_from_wire(wire)


def test_nested_tensordict_field_is_refused_with_a_hint():
    from tensordict import TensorDict
    td = TensorDict({"a": torch.zeros(2), "sub": TensorDict({"x": torch.ones(2)}, batch_size=[2])},
                    batch_size=[2])
    with pytest.raises(ValueError, match="nested TensorDict.*flatten_keys"):
        to_columns(td)


def test_recent_set_keeps_only_the_newest_names():
    from asyncflow.transfer_queue.recent import RecentSet
    s = RecentSet(maxlen=3)
    for name in "abcd":
        s.add(name)
    assert "a" not in s and all(x in s for x in "bcd") and len(s) == 3
    s.add("b")  # re-adding refreshes: "c" is now the oldest
    s.add("e")
    assert "c" not in s and "b" in s
    s.discard("b")
    assert "b" not in s


# ---- malformed columns are refused where data enters ---------------------------------------

_BAD_COLUMNS = [
    (JaggedColumn(torch.arange(3), torch.tensor([0, 2, 10])), r"offsets end at 10 but values has 3 rows"),
    (JaggedColumn(torch.arange(3), torch.tensor([0, 3, 1, 3])), r"offsets decrease at row 1 \(3 -> 1\)"),
    (JaggedColumn(torch.arange(3), torch.tensor([1, 3])), r"offsets\[0\] is 1, must be 0"),
    (JaggedColumn(torch.arange(3), torch.tensor([0, 3], dtype=torch.int32)), r"1-D int64 .* got int32 of shape \[2\]"),
    (JaggedColumn(torch.arange(3), torch.tensor([[0, 3]])), r"1-D int64 .* got int64 of shape \[1, 2\]"),
    (JaggedColumn(torch.zeros(0), torch.zeros(0, dtype=torch.long)), r"rows \+ 1 entries, got int64 of shape \[0\]"),
    (JaggedColumn(torch.tensor(5), torch.tensor([0])), r"values is a 0-d tensor"),
    (JaggedColumn([1, 2], torch.tensor([0, 2])), r"must be tensors, got list and Tensor"),
    (FixedColumn(torch.tensor(5)), r"0-d tensor; a column needs one entry per row"),
    (FixedColumn([1, 2]), r"fixed column data is a list, not a tensor"),
    (ObjectColumn("abc"), r"items must be a list, got a str"),
]


@pytest.mark.parametrize("col,err", _BAD_COLUMNS)
def test_to_column_refuses_a_malformed_column_naming_it_and_the_cause(col, err):
    with pytest.raises(ValueError, match=rf"column 'resp': .*{err}"):
        to_column("resp", col)
    with pytest.raises(ValueError, match=err):
        to_columns({"k": torch.arange(2), "resp": col})


@pytest.mark.parametrize("col,err", _BAD_COLUMNS)
def test_checked_wire_column_refuses_what_to_column_refuses(col, err):
    with pytest.raises(CodecError, match=err):
        column_from_wire(column_to_wire(col), check=True)


def test_well_formed_columns_pass_the_checks_unchanged():
    good = [_jag(ROWS), _jag(PER_TOKEN), _jag([torch.zeros(0)]),
            JaggedColumn(torch.zeros(0), torch.zeros(1, dtype=torch.long)),  # no rows: offsets [0]
            FixedColumn(torch.zeros(0, 3)), ObjectColumn([]), ObjectColumn(["a", {"b": 1}])]
    for col in good:
        assert to_column("c", col) is col
        back = column_from_wire(column_to_wire(col), check=True)
        assert type(back) is type(col) and len(back) == len(col)


def test_reply_path_does_not_check_offsets():
    """Replies come from a unit that checked the columns on put: reading them stays as cheap
    as before (only the offsets' dtype and rank), so the unchecked form still builds."""
    col = column_from_wire({"k": "jagged", "values": torch.arange(3), "offsets": torch.tensor([0, 2, 10])})
    assert col.offsets.tolist() == [0, 2, 10]


def test_object_column_nbytes_counts_content():
    over = 56  # the per-item overhead: a str header plus its list slot
    assert ObjectColumn([]).nbytes == 0
    assert ObjectColumn(["", "abc"]).nbytes == 2 * over + 3
    assert ObjectColumn(["é€"]).nbytes == over + 2 + 3  # UTF-8 bytes, not characters
    assert ObjectColumn(["\ud800"]).nbytes == over + 3  # a lone surrogate is still counted
    assert ObjectColumn([b"xyz", 5, 1.5, None, True]).nbytes == 5 * over + 3 + 4 * 8
    # anything else: its compact JSON as it travels, tensors inside by their bytes
    assert ObjectColumn([{"a": [1, 2]}, ["x"]]).nbytes == 2 * over + len('{"a":[1,2]}') + len('["x"]')
    assert ObjectColumn([{"t": torch.zeros(4)}]).nbytes == over + len('{"t":0}') + 16
    big = "x" * 10_000_000
    assert ObjectColumn([big]).nbytes == over + 10_000_000
    # what JSON cannot write (tuple keys; only an in-process put carries it) counts its repr
    assert ObjectColumn([{(1, 2): 3}]).nbytes == over + len(repr({(1, 2): 3}))


def test_rows_and_values_read_columns_as_they_read_get_data_s_tensordict():
    from asyncflow.transfer_queue.columns import to_column, to_tensordict
    from asyncflow.transfer_queue.row_lists import rows, values
    cols = {"ids": to_column("ids", [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long), torch.tensor([3])]),
            "seed": to_column("seed", torch.tensor([7, 8, 9])),
            "answer": to_column("answer", ["a", "b", "c"])}
    td = to_tensordict(cols, 3)
    assert [r.tolist() for r in rows(cols["ids"])] == [r.tolist() for r in rows(td["ids"])] == [[1, 2], [], [3]]
    assert values(cols["seed"]) == values(td["seed"]) == [7, 8, 9]
    assert values(cols["answer"]) == values(td["answer"]) == ["a", "b", "c"]
    no_rows = to_column("ids", [torch.tensor([1])]).take([])
    assert rows(no_rows) == []


def test_a_list_of_rows_becomes_one_jagged_column_detached_from_autograd():
    rows = [torch.tensor([1.0, 2.0], requires_grad=True), torch.zeros(0), torch.tensor([3.0])]
    col = to_column("x", rows)
    assert isinstance(col, JaggedColumn) and not col.values.requires_grad
    assert col.values.tolist() == [1.0, 2.0, 3.0] and col.offsets.tolist() == [0, 2, 2, 3]
    plain = to_column("y", [torch.tensor([[1, 2]]), torch.tensor([[3, 4], [5, 6]])])  # rows of [len, 2]
    assert plain.values.tolist() == [[1, 2], [3, 4], [5, 6]] and plain.offsets.tolist() == [0, 1, 3]
