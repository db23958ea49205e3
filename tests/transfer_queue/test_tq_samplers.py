"""Samplers through a real service: whole GRPO groups, token-balanced DP parts, and the
data-parallel representative rule."""
from __future__ import annotations

import asyncio
import collections
import random

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import TransferQueueTimeout
from asyncflow.transfer_queue.balance import contiguous_partition, imbalance

GRPO4 = {"name": "grpo_group", "group_size": 4}


def _put_group_rows(client, partition, groups, start_key):
    keys = list(range(start_key, start_key + len(groups)))
    return client.put({"key": torch.tensor(keys)}, partition, groups=groups)


def _group_counts(meta):
    return collections.Counter(meta.groups)


def test_grpo_group_sampler_returns_only_whole_groups_when_members_arrive_interleaved(tq):
    c = tq.client
    c.create_partition("p")
    # Members of groups 0..3 arrive interleaved over several puts; no group is whole yet.
    _put_group_rows(c, "p", [0, 1, 2, 0, 1], 0)
    _put_group_rows(c, "p", [3, 2, 0, 1], 10)
    with pytest.raises(TransferQueueTimeout):
        c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=0.3)
    _put_group_rows(c, "p", [0, 3, 2], 20)  # group 0 is whole (4), group 2 has 3
    with pytest.raises(TransferQueueTimeout):  # one whole group is not a batch of two
        c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=0.3)
    _put_group_rows(c, "p", [1, 3], 30)  # group 1 is whole; group 3 has 3
    meta = c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=2)
    assert _group_counts(meta) == {0: 4, 1: 4}
    # The members of each group are contiguous in the batch (groups travel together).
    assert meta.groups == sorted(meta.groups, key=meta.groups.index)
    keys = c.get_columns(meta)["key"].data.tolist()
    assert sorted(keys) == [0, 1, 3, 4, 12, 13, 20, 30]
    # Groups 2 and 3 complete later, with their rows again not adjacent.
    _put_group_rows(c, "p", [9, 3, 9, 2], 40)
    meta = c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=2)
    assert _group_counts(meta) == {2: 4, 3: 4}
    with pytest.raises(TransferQueueTimeout):  # group 9 has 2 of 4 members
        c.get_meta(["key"], 4, "t", "p", GRPO4, timeout=0.2)


def test_grpo_group_sampler_drains_whole_groups_first_at_end_of_stream(tq):
    c = tq.client
    c.create_partition("p")
    _put_group_rows(c, "p", [5, 6, 5, 6, 5, 7, 5], 0)  # group 5 whole; 6 and 7 are not
    c.close_partition("p")
    first = c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=2)
    assert first.groups[:4] == [5, 5, 5, 5]
    assert sorted(first.groups) == [5, 5, 5, 5, 6, 6, 7]
    assert c.get_meta(["key"], 8, "t", "p", GRPO4, timeout=2).end_of_stream


def test_grpo_group_sampler_rejects_batch_size_not_a_multiple_of_group_size(tq):
    tq.client.create_partition("p")
    _put_group_rows(tq.client, "p", [0, 0, 0, 0], 0)
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        tq.client.get_meta(["key"], 6, "t", "p", GRPO4, timeout=1)
    assert tq.client.get_meta(["key"], 4, "t", "p", GRPO4, timeout=1).size == 4  # nothing consumed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_balanced_sampler_gives_equal_row_counts_and_balanced_tokens(tq, seed):
    rng = random.Random(seed)
    lengths = [min(int(rng.lognormvariate(6.0, 1.2)) + 1, 8192) for _ in range(64)]
    c = tq.client
    c.create_partition("p")
    c.put({"key": torch.arange(64), "resp": [torch.zeros(n, dtype=torch.int32) for n in lengths]}, "p")
    meta = c.get_meta(["key", "resp"], 64, "t", "p", {"name": "token_balanced", "dp_size": 4}, timeout=2)
    assert meta.dp_parts == [16, 16, 16, 16]
    keys = c.get_columns(meta)["key"].data.tolist()
    assert sorted(keys) == list(range(64))
    assert meta.tokens == [lengths[k] for k in keys]
    parts = meta.chunk(4)
    assert [len(p) for p in parts] == [16] * 4
    assert sorted(r for p in parts for r in p.rows) == sorted(meta.rows)
    balanced = imbalance(lengths, [[keys[meta.rows.index(r)] for r in p.rows] for p in parts])
    contiguous = imbalance(lengths, contiguous_partition(lengths, 4))  # ready (put) order, unbalanced
    assert contiguous > 1.15
    assert balanced - 1 < (contiguous - 1) / 20, (balanced, contiguous)


def test_token_balanced_sampler_with_groups_keeps_whole_groups(tq):
    c = tq.client
    c.create_partition("p")
    groups = [g for g in range(8) for _ in range(2)]
    random.Random(3).shuffle(groups)
    c.put({"resp": [torch.zeros(1 + 37 * i % 500, dtype=torch.int32) for i in range(16)]}, "p", groups=groups)
    spec = {"name": "token_balanced", "dp_size": 2, "group_size": 2}
    meta = c.get_meta(["resp"], 8, "t", "p", spec, timeout=2)
    assert meta.dp_parts == [4, 4]
    assert set(_group_counts(meta).values()) == {2}


def test_token_balanced_sampler_balances_tokens_when_rows_do_not_divide(tq):
    """9 rows (3 groups of 3) over 2 ranks: every row goes to a rank, token totals near-equal."""
    c = tq.client
    c.create_partition("p")
    lengths = [5, 90, 7, 40, 41, 3, 60, 8, 30]
    c.put({"key": torch.arange(9), "resp": [torch.zeros(n, dtype=torch.int32) for n in lengths]}, "p")
    meta = c.get_meta(["key", "resp"], 9, "t", "p", {"name": "token_balanced", "dp_size": 2}, timeout=2)
    assert sum(meta.dp_parts) == 9 and len(meta.dp_parts) == 2
    keys = c.get_columns(meta)["key"].data.tolist()
    parts = meta.chunk(2)
    totals = [sum(lengths[keys[meta.rows.index(r)]] for r in p.rows) for p in parts]
    assert sorted(r for p in parts for r in p.rows) == sorted(meta.rows)
    assert max(totals) / (sum(lengths) / 2) < 1.05, totals


def _take(c, dp_group, rank, n=4, **kw):
    return c.get_meta(["key"], n, "train", "p", dp_group=dp_group, dp_rank=rank, dp_size=2, timeout=2, **kw)


def test_dp_representative_every_member_of_a_group_gets_the_same_batch(tq):
    c = tq.client
    c.create_partition("p", tasks=["train", "other"])
    c.put({"key": torch.arange(24)}, "p")
    batches = {"g0": [], "g1": []}
    # Members ask in varied interleavings; rank 1 sometimes asks first (and so samples).
    order = [("g0", 0), ("g0", 1), ("g1", 1), ("g1", 0), ("g0", 1), ("g1", 0),
             ("g1", 1), ("g0", 0), ("g0", 0), ("g1", 0), ("g0", 1), ("g1", 1)]
    per_member = collections.defaultdict(list)
    for g, r in order:
        per_member[(g, r)].append(_take(c, g, r).rows)
    for g in ("g0", "g1"):
        assert per_member[(g, 0)] == per_member[(g, 1)], f"members of {g} got different batches"
        batches[g] = per_member[(g, 0)]
    all_rows = [r for g in batches.values() for b in g for r in b]
    assert len(all_rows) == 24 and len(set(all_rows)) == 24  # disjoint across groups, each row once
    # Another task still sees every row.
    assert c.get_meta(["key"], 24, "other", "p", timeout=2).size == 24
    st = c.status("p")
    assert st["consumed"]["train"] == 24


def test_dp_representative_rejects_bad_rank_and_size(tq):
    c = tq.client
    c.create_partition("p")
    c.put({"key": torch.arange(8)}, "p")
    with pytest.raises(ValueError, match="dp_rank 2 outside a group of size 2"):
        _take(c, "g", 2)
    _take(c, "g", 0)
    with pytest.raises(ValueError, match="has size 2, not 3"):
        c.get_meta(["key"], 4, "train", "p", dp_group="g", dp_rank=0, dp_size=3, timeout=1)


def test_dp_members_waiting_together_both_get_the_one_batch_that_arrives(tq):
    """Both members of a DP group ask before any row is ready; one batch arrives. The member
    that did not sample must get the batch its peer sampled, promptly, not wait for another."""
    async def main():
        c = tq.async_client()
        try:
            await c.create_partition("p", tasks=["train"])
            asks = [asyncio.ensure_future(c.get_meta(["key"], 4, "train", "p", dp_group="g", dp_rank=r,
                                                     dp_size=2, timeout=60)) for r in (0, 1)]
            await asyncio.sleep(0.2)
            assert not any(a.done() for a in asks)
            await c.put({"key": torch.arange(4)}, "p")
            # Both back long before their own 60 s timeout: the one batch serves them both
            # (a member left waiting for another batch would sit until then).
            m0, m1 = await asyncio.wait_for(asyncio.gather(*asks), 20)
            assert m0.rows == m1.rows and len(m0.rows) == 4
        finally:
            await c.close()
    H.run_async(main(), 60)


def test_grpo_group_partial_on_an_open_partition_returns_whole_groups_only(tq):
    c = tq.client
    c.create_partition("p")
    c.put({"k": torch.arange(3)}, "p", groups=[0, 0, 1])  # group 0 whole, group 1 half
    meta = c.get_meta(["k"], 4, "t", "p", {"name": "grpo_group", "group_size": 2}, allow_partial=True)
    assert sorted(meta.groups) == [0, 0]
    c.close_partition("p")  # at end of stream the incomplete group drains too
    rest = c.get_meta(["k"], 4, "t", "p", {"name": "grpo_group", "group_size": 2}, timeout=2)
    assert rest.groups == [1]


def _reference_group_batch(ready, groups, n, batch_size, partial, ended):
    """Grouped sampling as a walk of every ready row in order (the definition the index must
    match): groups in the order their n-th ready row came; at end of stream, the rest."""
    buckets, done = {}, []
    for r in ready:
        b = buckets.setdefault(groups[r], [])
        b.append(r)
        if len(b) == n:
            done.append(groups[r])
    done = done[:batch_size // n]
    rows = [r for g in done for r in buckets[g]]
    if len(done) == batch_size // n or (partial and done and not ended):
        return rows
    if ended and ready:
        rest = [r for g, b in buckets.items() if g not in done for r in b]
        return (rows + rest)[:batch_size]
    return None


def test_grouped_sampling_from_the_kept_index_matches_a_walk_of_the_ready_rows():
    """Random arrivals, consumption, clears and hand-backs: the index kept in step by
    ReadyRows.add/remove gives the batches a full walk of the ready rows would give."""
    from types import SimpleNamespace

    from asyncflow.transfer_queue.samplers import GroupSampler, ReadyRows
    rng = random.Random(3)
    n, sampler = 4, GroupSampler(4)
    info = SimpleNamespace(groups={}, tokens={})
    ready, next_row, taken = ReadyRows(), 0, []
    for step in range(600):
        op = rng.random()
        if op < 0.4:  # rows of random groups arrive (a group never exceeds n rows)
            rows = []
            for _ in range(rng.randint(1, 6)):
                g = rng.randrange(40)
                if sum(1 for h in info.groups.values() if h == g) < n:
                    info.groups[next_row] = g
                    rows.append(next_row)
                    next_row += 1
            ready.add(rows)
        elif op < 0.5 and ready:  # a clear of some ready rows: they and their group ids go
            gone = rng.sample(list(ready), min(len(ready), rng.randint(1, 3)))
            ready.remove(gone)
            for r in gone:
                del info.groups[r]
        elif op < 0.6 and taken:  # a DP peer hands rows back
            back = taken.pop(rng.randrange(len(taken)))
            ready.add([r for r in back if r in info.groups and r not in ready])
        else:
            size = n * rng.randint(1, 3)
            partial, ended = rng.random() < 0.3, rng.random() < 0.1
            want = _reference_group_batch(list(ready), info.groups, n, size, partial, ended)
            got = sampler.sample(ready, size, info, partial=partial, ended=ended)
            assert (got.rows if got else None) == (want or None), (step, partial, ended)
            if got:
                ready.remove(got.rows)
                taken.append(got.rows)
