"""A random walk over the TransferQueue's client API, checked step by step against a plain
Python model of what the service must hold.

The model knows, per partition, every live row (its key, its columns, its GRPO group in
partition "g") and, per consumer task, the rows that task consumed. Each step is one
client call on a real service with two storage units: new rows, a column added to rows
chosen at random (often across both units), get_meta or get_batch with allow_partial
(whole groups only in "g"), reads of the bytes, clear_rows, reset_consumption, status,
and refused writes (a column written twice, a write touching a cleared row, a column of
another dtype). At the end every task drains every column set, then each partition is
closed (end of stream) and cleared.

After every step the service must agree with the model: get_meta hands out only rows
that have the columns and that the task has not consumed, never one twice, as many as
the model has ready, and in "g" only whole groups, as many as are whole; reads return
the bytes the row's key defines; a refused write changes nothing (the rows it did not
refuse can still take the column afterwards); reads of cleared rows fail.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from _tq_helpers import check_rows, make_rows, make_scores, row_feat, row_score, row_text, row_tokens

from asyncflow.transfer_queue import BadPutError, BatchMeta, RowsClearedError, SchemaMismatchError
from asyncflow.transfer_queue.meta import unit_of

PARTITIONS = ("p0", "p1", "g")  # "g": rows put with GRPO group ids, read whole groups only
GROUPED = "g"
GROUP = 4  # rows per group
GROUP_SAMPLER = {"name": "grpo_group", "group_size": GROUP}
TASKS = ("a", "b", "c")
READS = (("key", "tokens"), ("key", "score"), ("key", "text", "feat"), ("key", "tokens", "score"))
BASE = {"key", "tokens", "feat", "text"}  # what a put of new rows carries


@dataclass
class _Part:
    rows: dict[int, set[str]] = field(default_factory=dict)  # live row -> its columns
    key: dict[int, int] = field(default_factory=dict)  # row -> key (kept after a clear)
    consumed: dict[str, set[int]] = field(default_factory=dict)
    cleared: set[int] = field(default_factory=set)
    group: dict[int, int] = field(default_factory=dict)  # row -> group id (partition "g")

    def ready(self, task: str, cols: tuple[str, ...]) -> set[int]:
        done = self.consumed.get(task, set())
        return {r for r, have in self.rows.items() if r not in done and set(cols) <= have}

    def whole_groups(self, task: str, cols: tuple[str, ...]) -> dict[int, set[int]]:
        """Groups all of whose GROUP rows are ready: what the group sampler may hand out."""
        members: dict[int, set[int]] = {}
        for r in self.ready(task, cols):
            members.setdefault(self.group[r], set()).add(r)
        return {g: rs for g, rs in members.items() if len(rs) == GROUP}


class _Walk:
    def __init__(self, client, seed: int):
        self.c = client
        self.rng = random.Random(seed)
        self.parts = {p: _Part() for p in PARTITIONS}
        self.next_key = 0
        self.next_group = 0
        self.tasks_used: set[str] = set()
        for p in PARTITIONS:
            self.c.create_partition(p)

    def _meta(self, p: str, rows: list[int]) -> BatchMeta:
        return BatchMeta(p, list(rows), [])

    # ---- steps ---------------------------------------------------------------------
    def put_rows(self, p: str) -> None:
        part = self.parts[p]
        groups = self._new_group_ids(part) if p == GROUPED else None
        n = len(groups) if groups is not None else self.rng.randint(1, 12)
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += len(keys)
        meta = self.c.put(make_rows(keys), p, groups=groups)
        assert len(meta.rows) == len(keys) and not set(meta.rows) & set(part.key), "row ids reused"
        for i, (r, k) in enumerate(zip(meta.rows, keys)):
            part.rows[r] = set(BASE)
            part.key[r] = k
            if groups is not None:
                part.group[r] = groups[i]

    def _new_group_ids(self, part: _Part) -> list[int]:
        """Group ids for a put: some rows of groups begun in earlier puts (responses of one
        prompt arrive in several puts), some of new groups, never more than GROUP a group."""
        count: dict[int, int] = {}
        for g in part.group.values():
            count[g] = count.get(g, 0) + 1
        open_groups = [g for g, n in count.items() if n < GROUP]
        out: list[int] = []
        for g in self.rng.sample(open_groups, min(len(open_groups), self.rng.randint(0, 3))):
            out += [g] * self.rng.randint(1, GROUP - count[g])
        for _ in range(self.rng.randint(0 if out else 1, 2)):
            g, self.next_group = self.next_group, self.next_group + 1
            out += [g] * self.rng.randint(1, GROUP)
        self.rng.shuffle(out)
        return out

    def _lacking_score(self, p: str) -> list[int]:
        return [r for r, have in self.parts[p].rows.items() if "score" not in have]

    def put_scores(self, p: str) -> None:
        lacking = self._lacking_score(p)
        if not lacking:
            return
        rows = self.rng.sample(lacking, self.rng.randint(1, min(8, len(lacking))))
        part = self.parts[p]
        self.c.put(make_scores([part.key[r] for r in rows]), p, self._meta(p, rows))
        for r in rows:
            part.rows[r].add("score")

    def refused_put(self, p: str) -> None:
        """A column put that must be refused whole: afterwards the rows it named that could
        take the column still can, and the rows that had it keep their bytes."""
        part = self.parts[p]
        lacking = self._lacking_score(p)
        having = [r for r, have in part.rows.items() if "score" in have]
        kind = self.rng.choice(["twice", "cleared", "dtype"])
        if kind == "twice" and having:
            rows = self.rng.sample(lacking, min(3, len(lacking))) + [self.rng.choice(having)]
            err = BadPutError
        elif kind == "cleared" and part.cleared:
            rows = self.rng.sample(lacking, min(3, len(lacking))) + [self.rng.choice(sorted(part.cleared))]
            err = RowsClearedError
        elif kind == "dtype" and lacking:
            rows = self.rng.sample(lacking, min(3, len(lacking)))
            if not any("score" in have for have in part.rows.values()) and not self._score_written(p):
                return  # no score stored yet: any dtype would be accepted as the first
            data = {"score": torch.tensor([row_score(part.key[r]) for r in rows], dtype=torch.float32)}
            with pytest.raises(SchemaMismatchError):
                self.c.put(data, p, self._meta(p, rows))
            return
        else:
            return
        self.rng.shuffle(rows)
        with pytest.raises(err):
            self.c.put(make_scores([part.key[r] for r in rows]), p, self._meta(p, rows))

    def _score_written(self, p: str) -> bool:
        st = self.c.status(p)
        return "score" in st["columns"]

    def get_meta(self, p: str) -> None:
        task = self.rng.choice(TASKS)
        cols = self.rng.choice(READS)
        part = self.parts[p]
        want = part.ready(task, cols)
        n = GROUP * self.rng.randint(1, 4) if p == GROUPED else self.rng.randint(1, 16)
        sampler = GROUP_SAMPLER if p == GROUPED else "sequential"
        fused = self.rng.random() < 0.5  # get_batch: the same consumption, the data in the same hop
        if fused:
            meta, td = self.c.get_batch(list(cols), n, task, p, sampler, allow_partial=True, timeout=5)
        else:
            meta = self.c.get_meta(list(cols), n, task, p, sampler, allow_partial=True, timeout=5)
        self.tasks_used.add(task)
        got = meta.rows
        assert len(got) == len(set(got)), f"a row twice in one batch: {got}"
        assert set(got) <= want, f"task {task} got rows not ready for {cols}: {sorted(set(got) - want)}"
        if p == GROUPED:  # whole groups, as many as are whole and ready (up to what was asked)
            whole = part.whole_groups(task, cols)
            got_groups = {part.group[r] for r in got}
            assert all(whole.get(g) <= set(got) for g in got_groups), f"task {task}: a group split: {got}"
            assert len(got_groups) == min(n // GROUP, len(whole)), (task, cols, len(got_groups), len(whole))
        else:
            assert len(got) == min(n, len(want)), f"task {task} got {len(got)} of {len(want)} ready (asked {n})"
        part.consumed.setdefault(task, set()).update(got)
        if fused and got:
            self._check_batch(p, got, cols, td)
        elif fused:
            assert td is None
        elif got:
            self._check_read(p, got, cols)

    def _check_batch(self, p: str, rows: list[int], cols: tuple[str, ...], td) -> None:
        """A get_batch's TensorDict: the meta's rows, in its order, with the keys' bytes."""
        keys = [self.parts[p].key[r] for r in rows]
        assert td.batch_size[0] == len(rows) and sorted(td.keys()) == sorted(cols)
        assert td["key"].tolist() == keys, "get_batch data in another order than its meta"
        for name in cols:
            if name in ("tokens", "feat"):
                want = [row_tokens(k) if name == "tokens" else row_feat(k) for k in keys]
                assert all(torch.equal(a, b) for a, b in zip(td[name].unbind(), want)), name
            elif name == "score":
                assert td["score"].tolist() == [row_score(k) for k in keys]
            elif name == "text":
                assert list(td["text"]) == [row_text(k) for k in keys]  # tensordict < 0.15: a list without .tolist()

    def _check_read(self, p: str, rows: list[int], cols: tuple[str, ...]) -> None:
        part = self.parts[p]
        read = self.c.get_columns(self._meta(p, rows), list(cols))
        assert list(read) == list(cols)
        assert read["key"].data.tolist() == [part.key[r] for r in rows], "rows came back in another order"
        assert check_rows([part.key[r] for r in rows], read) == []

    def read_some(self, p: str) -> None:
        part = self.parts[p]
        if not part.rows:
            return
        rows = self.rng.sample(sorted(part.rows), self.rng.randint(1, min(10, len(part.rows))))
        cols = [c for c in ("key", "tokens", "feat", "text", "score") if all(c in part.rows[r] for r in rows)]
        self._check_read(p, rows, tuple(cols))

    def clear_some(self, p: str) -> None:
        part = self.parts[p]
        if not part.rows:
            return
        rows = self.rng.sample(sorted(part.rows), self.rng.randint(1, min(6, len(part.rows))))
        assert self.c.clear_rows(self._meta(p, rows)) == len(rows)
        for r in rows:
            del part.rows[r]
            part.cleared.add(r)
            for done in part.consumed.values():
                done.discard(r)
        with pytest.raises(RowsClearedError):
            self.c.get_columns(self._meta(p, rows[:1]), ["key"])

    def reset(self, p: str) -> None:
        if not self.tasks_used:
            return
        task = self.rng.choice(sorted(self.tasks_used))
        self.c.reset_consumption(p, task)
        self.parts[p].consumed.pop(task, None)

    def check_status(self, p: str) -> None:
        part = self.parts[p]
        st = self.c.status(p)
        assert st["rows"] == len(part.rows)
        assert st["column_rows"].get("score", 0) == sum("score" in have for have in part.rows.values())
        for task, n in st["consumed"].items():
            assert n == len(part.consumed.get(task, ())), f"task {task}: {n} consumed, model says otherwise"

    def drain(self) -> None:
        """Every task reads every column set to the end: exactly what the model has ready
        (in partition "g": the rows of the groups that are whole)."""
        for p, part in self.parts.items():
            for task in TASKS:
                for cols in READS:
                    if p == GROUPED:
                        want = set().union(*part.whole_groups(task, cols).values())
                        how = dict(batch_size=2 * GROUP, sampler=GROUP_SAMPLER)
                    else:
                        want, how = part.ready(task, cols), dict(batch_size=7)
                    got: list[int] = []
                    while True:
                        meta = self.c.get_meta(list(cols), task=task, partition=p, allow_partial=True, timeout=5,
                                               **how)
                        if not meta.rows:
                            break
                        got += meta.rows
                        part.consumed.setdefault(task, set()).update(meta.rows)
                    assert len(got) == len(set(got)) and set(got) == want, (p, task, cols)

    def end(self) -> None:
        """Close each partition: no new rows, and a task with every row seen gets end of stream
        at once (no wait); then clear it: every live row is freed, and the name is gone."""
        for p, part in self.parts.items():
            self.c.close_partition(p)
            with pytest.raises(BadPutError):
                self.put_rows(p)
            for task in TASKS:
                if p == GROUPED:  # at the end of the stream the rest of the groups go too
                    left, got = part.ready(task, ("key", "tokens")), []
                    while not (meta := self.c.get_meta(["key", "tokens"], GROUP, task, p, GROUP_SAMPLER,
                                                       timeout=5)).end_of_stream:
                        got += meta.rows
                    assert sorted(got) == sorted(left), (task, len(got), len(left))
                meta = self.c.get_meta(["key", "tokens"], 4, task, p, timeout=5)
                assert meta.end_of_stream and not meta.rows, (p, task)
            assert self.c.clear(p) == len(part.rows)
            with pytest.raises(RowsClearedError):
                self.c.get_meta(["key"], 1, "a", p, allow_partial=True, timeout=5)


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_over_the_api_matches_the_model(tq_factory, seed):
    tq = tq_factory(num_local_units=2)
    walk = _Walk(tq.client, seed)
    steps = [(walk.put_rows, 6), (walk.put_scores, 6), (walk.get_meta, 10), (walk.read_some, 3),
             (walk.clear_some, 2), (walk.refused_put, 3), (walk.reset, 1), (walk.check_status, 2)]
    fns, weights = zip(*steps)
    for _ in range(250):
        step = walk.rng.choices(fns, weights)[0]
        step(walk.rng.choice(PARTITIONS))
    for p in PARTITIONS:
        walk.check_status(p)
    walk.drain()
    walk.end()
    # Rows of both units were written across in one put (the multi-unit path was taken).
    units = {unit_of(r) for part in walk.parts.values() for r in part.key}
    assert units == {0, 1}
