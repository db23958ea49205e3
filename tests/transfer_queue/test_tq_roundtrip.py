"""Round trips through a real service: variable-length columns stay unpadded in storage
and on the wire and come back equal; object columns, bfloat16, and row order across
storage units survive."""
from __future__ import annotations

import random

import torch
from tensordict import NonTensorStack, TensorDict

from asyncflow.rpc.codec import encode
from asyncflow.transfer_queue import BatchMeta, JaggedColumn
from asyncflow.transfer_queue.columns import column_to_wire, to_column
from asyncflow.transfer_queue.meta import unit_of


def _rows(lengths, dtype=torch.int64, tail=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(n, *tail, generator=g).to(dtype) for n in lengths]
    return [torch.randint(0, 1 << 30, (n, *tail), generator=g, dtype=dtype) for n in lengths]


def _assert_rows_equal(got, want):
    got = list(got.unbind()) if isinstance(got, torch.Tensor) else list(got)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _stored_batches(tq):
    return tq.on_loop(lambda: [b.columns for b in tq.service.units[0].batches.values()])


def test_jagged_list_nested_and_per_token_columns_round_trip_equal(tq):
    lengths = [5, 1, 0, 17, 3, 9]
    ids = _rows(lengths, seed=1)
    logp = _rows(lengths, torch.float32, seed=2)
    per_tok = _rows(lengths, torch.float32, tail=(4,), seed=3)  # [len, 4]
    td = TensorDict({
        "ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        "logp": torch.nested.nested_tensor(logp, layout=torch.jagged),
        "per_tok": torch.nested.nested_tensor(per_tok, layout=torch.jagged),
        "reward": torch.arange(6, dtype=torch.float32),
    }, batch_size=[6])
    tq.client.create_partition("p")
    meta = tq.client.put(td, "p")
    out = tq.client.get_data(meta)
    assert out.batch_size == torch.Size([6])
    _assert_rows_equal(out["ids"], ids)
    _assert_rows_equal(out["logp"], logp)
    _assert_rows_equal(out["per_tok"], per_tok)
    assert torch.equal(out["reward"], td["reward"])
    assert meta.tokens == [3 * n for n in lengths]  # one count per jagged column, per row

    # A plain list of 1-D tensors is a jagged column too; only the asked column comes back.
    tq.client.create_partition("q")
    m2 = tq.client.put({"resp": ids}, "q")
    cols = tq.client.get_columns(m2, ["resp"])
    assert list(cols) == ["resp"] and isinstance(cols["resp"], JaggedColumn)
    _assert_rows_equal([cols["resp"].row(i) for i in range(6)], ids)


def test_jagged_columns_are_stored_without_padding(tq):
    lengths = [7, 300, 1, 42]
    tq.client.create_partition("p")
    tq.client.put({"ids": _rows(lengths), "per_tok": _rows(lengths, torch.float32, tail=(4,))}, "p")
    (cols,) = _stored_batches(tq)
    for name, tail in (("ids", ()), ("per_tok", (4,))):
        c = cols[name]
        assert isinstance(c, JaggedColumn)
        assert tuple(c.values.shape) == (sum(lengths), *tail), f"{name} holds padding"
        assert c.offsets.tolist() == [0, 7, 307, 308, 350]


def test_jagged_column_travels_without_padding_on_the_wire():
    lengths = [7, 300, 1, 42]
    for dtype, tail in ((torch.int64, ()), (torch.bfloat16, ()), (torch.float32, (4,))):
        col = to_column("c", _rows(lengths, dtype, tail=tail))
        frames = encode(column_to_wire(col))
        assert len(frames) == 3  # header, values, offsets
        width = 1
        for t in tail:
            width *= t
        assert frames[1].nbytes == sum(lengths) * width * col.values.element_size()
        assert frames[2].nbytes == (len(lengths) + 1) * 8


def test_object_columns_round_trip(tq):
    items_s = ["the answer is 42", "", "ünïcödé ✓", "x" * 1000]
    items_d = [{"gt": "42", "tags": ["a", "b"]}, {"n": None}, {"nested": {"k": [1, 2.5, True]}}, {}]
    tq.client.create_partition("p")
    td = TensorDict({"answer": NonTensorStack(*items_s), "x": torch.zeros(4)}, batch_size=[4])
    meta = tq.client.put(td, "p")
    tq.client.put({"info": items_d}, "p", meta)
    out = tq.client.get_data(meta.with_columns(["answer", "info"]))
    assert list(out["answer"]) == items_s
    assert list(out["info"]) == items_d
    cols = tq.client.get_columns(meta.with_columns(["answer", "info"]))
    assert cols["answer"].items == items_s and cols["info"].items == items_d


def test_bfloat16_fixed_and_jagged_round_trip_bit_exact(tq):
    g = torch.Generator().manual_seed(0)
    fixed = torch.randn(5, 3, generator=g).to(torch.bfloat16)
    jag = _rows([4, 0, 2, 9, 1], torch.bfloat16, seed=5)
    tq.client.create_partition("p")
    meta = tq.client.put({"f": fixed, "j": jag}, "p")
    cols = tq.client.get_columns(meta)
    assert cols["f"].data.dtype == torch.bfloat16
    assert torch.equal(cols["f"].data.view(torch.int16), fixed.view(torch.int16))
    assert cols["j"].values.dtype == torch.bfloat16
    _assert_rows_equal([cols["j"].row(i) for i in range(5)], jag)


def test_reads_in_any_order_across_two_units_follow_the_meta_order(tq_factory):
    tq = tq_factory(num_local_units=2)
    tq.client.create_partition("p")
    to0, to1 = tq.new_client(preferred_unit=0), tq.new_client(preferred_unit=1)
    keys0, keys1 = list(range(20)), list(range(100, 115))
    lens = {k: 1 + k % 11 for k in keys0 + keys1}
    payload = {k: torch.full((lens[k],), k, dtype=torch.int32) for k in lens}

    def put(c, keys):
        return c.put({"key": torch.tensor(keys), "ids": [payload[k] for k in keys],
                      "name": [f"k{k}" for k in keys]}, "p")

    m0, m1 = put(to0, keys0), put(to1, keys1)
    assert {unit_of(r) for r in m0.rows} == {0} and {unit_of(r) for r in m1.rows} == {1}
    both = BatchMeta.concat([m0, m1])
    rng = random.Random(7)
    for _ in range(3):
        perm = list(range(len(both)))
        rng.shuffle(perm)
        meta = both.select(perm)
        out = tq.client.get_columns(meta)
        want = [both.rows.index(r) for r in meta.rows]
        want_keys = [(keys0 + keys1)[i] for i in want]
        assert out["key"].data.tolist() == want_keys
        assert out["name"].items == [f"k{k}" for k in want_keys]
        _assert_rows_equal([out["ids"].row(i) for i in range(len(meta))], [payload[k] for k in want_keys])
    # get_meta hands out rows of both units; get_data returns them in the meta's order.
    got = tq.client.get_meta(["key", "ids"], len(both), "t", "p")
    assert sorted(got.rows) == sorted(both.rows)
    td = tq.client.get_data(got)
    keys = td["key"].tolist()
    assert sorted(keys) == sorted(keys0 + keys1)
    _assert_rows_equal(td["ids"], [payload[k] for k in keys])
