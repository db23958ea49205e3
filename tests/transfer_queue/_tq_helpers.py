"""Helpers shared by the TransferQueue tests, including the entry points of the producer,
consumer and storage-unit processes of the multi-process tests (they must be importable
by name from a child started with 'forkserver' or 'spawn').

Rows carry a ``key``; every other column of a row is a pure function of the key, so a
consumer checks the bytes it received without talking to the producer.
"""
from __future__ import annotations

import asyncio
import collections
import random
import traceback

import torch

FEAT_SCALE = torch.tensor([0.5, -0.25, 2.0, 1.0])  # exact in float32 for the integers used

# Client-side limits used throughout: a reply must come within RPC_TIMEOUT; a get_meta or a
# put waiting for room waits WAIT_TIMEOUT unless the test says otherwise.
RPC_TIMEOUT = 20.0
WAIT_TIMEOUT = 5.0


def run_async(coro, timeout: float = 30.0):
    """Run a coroutine to completion in a fresh loop, failing (not hanging) after ``timeout``."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- payload derived from a row key --------------------------------------------------

def row_len(key: int) -> int:
    return 1 + (key * 2654435761 % 4294967296) % 61  # 1..61 tokens


def row_tokens(key: int) -> torch.Tensor:
    n = row_len(key)
    return (key * 1000003 + torch.arange(n, dtype=torch.int64) * 7919) % 50257


def row_feat(key: int) -> torch.Tensor:
    """Per-token 2-D values [len, 4]."""
    return row_tokens(key).to(torch.float32)[:, None] * FEAT_SCALE


def row_text(key: int) -> str:
    return f"row-{key}-" + "x" * (key % 7)


def row_score(key: int) -> float:
    return key * 0.5


def make_rows(keys: list[int]) -> dict:
    return {
        "key": torch.tensor(keys, dtype=torch.int64),
        "tokens": [row_tokens(k) for k in keys],
        "feat": [row_feat(k) for k in keys],
        "text": [row_text(k) for k in keys],
    }


def make_scores(keys: list[int]) -> dict:
    return {"score": torch.tensor([row_score(k) for k in keys], dtype=torch.float64)}


def plain_column(col) -> tuple:
    """A received Column as plain Python values (kind, dtype, contents), to compare whole
    states: what the service holds before and after a request it must refuse."""
    from asyncflow.transfer_queue.columns import FixedColumn, JaggedColumn

    if isinstance(col, FixedColumn):
        return ("fixed", str(col.data.dtype), col.data.tolist())
    if isinstance(col, JaggedColumn):
        return ("jagged", str(col.values.dtype), col.values.tolist(), col.offsets.tolist())
    return ("object", col.items)


def check_rows(keys: list[int], cols: dict) -> list[str]:
    """Compare received columns with the payload derived from ``keys``; return mismatches."""
    bad = []
    for i, k in enumerate(keys):
        for name, col in cols.items():
            if name == "key":
                continue
            if name == "tokens":
                ok = torch.equal(col.row(i), row_tokens(k))
            elif name == "feat":
                ok = torch.equal(col.row(i), row_feat(k))
            elif name == "text":
                ok = col.items[i] == row_text(k)
            elif name == "score":
                ok = float(col.data[i]) == row_score(k)
            else:
                ok = False
            if not ok:
                bad.append(f"key {k}: column {name!r} differs")
    return bad


# ---- process entry points -------------------------------------------------------------

def producer_main(address: str, partition: str, keys: list[int], seed: int, out) -> None:
    """Put ``keys`` in random batch sizes; add the ``score`` column later, in a shuffled order,
    sometimes for the rows of two puts at once (which may live in different storage units)."""
    from asyncflow.transfer_queue import BatchMeta, TransferQueueClient
    try:
        rng = random.Random(seed)
        pending: list[tuple[BatchMeta, list[int]]] = []  # rows still lacking "score"
        row_keys: list[tuple[int, int]] = []  # (row id the TQ gave, key), for the parent to check reads
        with TransferQueueClient(address, timeout=60, wait_timeout=60) as c:
            i = 0
            while i < len(keys):
                batch = keys[i:i + rng.randint(1, 64)]
                i += len(batch)
                meta = c.put(make_rows(batch), partition)
                row_keys += zip(meta.rows, batch)
                pending.append((meta, batch))
                while len(pending) > rng.randint(0, 4):
                    take = [pending.pop(rng.randrange(len(pending))) for _ in range(min(len(pending), 2))]
                    meta = BatchMeta.concat([m for m, _ in take])
                    c.put(make_scores([k for _, ks in take for k in ks]), partition, meta)
            for meta, batch in pending:
                c.put(make_scores(batch), partition, meta)
        out.put(("producer", seed, row_keys, None, 0))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out.put(("producer", seed, [], traceback.format_exc(), 0))


def consumer_main(address: str, partition: str, task: str, columns: list[str], seed: int, out) -> None:
    """Consume ``task`` until end of stream with random batch sizes; check every byte. Reports
    the (row id, key) pairs it read; stops at the first row it sees twice."""
    from asyncflow.transfer_queue import TransferQueueClient
    from asyncflow.transfer_queue.meta import unit_of
    keys: list[tuple[int, int]] = []
    seen: set[int] = set()
    errors: list[str] = []
    mixed = 0  # batches whose rows live in more than one storage unit
    try:
        rng = random.Random(seed)
        with TransferQueueClient(address, timeout=60, wait_timeout=60) as c:
            while True:
                meta = c.get_meta(columns, rng.randint(1, 48), task, partition, timeout=60)
                if meta.end_of_stream:
                    break
                if not meta.rows:
                    errors.append("empty meta without end_of_stream")
                    break
                cols = c.get_columns(meta)
                got = cols["key"].data.tolist()
                errors += check_rows(got, cols)[:5]
                keys += zip(meta.rows, got)
                mixed += len({unit_of(r) for r in meta.rows}) > 1
                again = sorted(seen.intersection(meta.rows)) + [
                    r for r, n in collections.Counter(meta.rows).items() if n > 1]
                seen.update(meta.rows)
                if again:
                    errors.append(f"rows handed to this consumer twice: {again[:5]}")
                if errors:
                    break
        out.put(("consumer", task, keys, errors[:20] or None, mixed))
    except BaseException:  # noqa: BLE001
        out.put(("consumer", task, keys, [traceback.format_exc()], mixed))


def storage_unit_main(address: str, index: int, ready) -> None:
    from asyncflow.transfer_queue import serve_storage_unit
    asyncio.run(serve_storage_unit(address, index, wait_timeout_s=60.0, ready=ready))
