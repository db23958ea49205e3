"""Exactly-once delivery under concurrency, with real producer and consumer processes.

Two producer processes write 3000 rows (random batch sizes; jagged, per-token 2-D and
string columns) and later add a ``score`` column to them in shuffled order; three
consumer tasks read them with random batch sizes until end of stream. Every row must
reach every task exactly once with its bytes unchanged. The second variant adds a
storage unit running in its own process, and two consumer processes sharing a task.

Children are started with 'forkserver' (torch is preloaded once in the fork server, so
each child starts in well under a second). Every wait has a timeout; every child is
joined with a timeout and killed if it is still alive.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import queue
import time

import _tq_helpers as H
import pytest

from asyncflow.transfer_queue import TransferQueueClient, TransferQueueConfig, TransferQueueService

N_ROWS = 3000
DEADLINE_S = 60.0
TASKS = {  # task -> columns it reads
    "reward": ["key", "tokens", "text"],
    "ref": ["key", "tokens", "feat"],
    "train": ["key", "feat", "score"],
}


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "asyncflow.transfer_queue", "_tq_helpers"])
    return ctx


def _get(q, deadline: float, what: str):
    left = deadline - time.monotonic()
    try:
        return q.get(timeout=max(left, 0.1))
    except queue.Empty:
        pytest.fail(f"timed out waiting for {what}")


def _stop(procs: list, timeout: float = 10.0) -> None:
    """Join every process within ``timeout`` in all; kill what is still alive."""
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(end - time.monotonic(), 0.01))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


@pytest.mark.slow
@pytest.mark.parametrize("remote_unit,consumers_per_task", [(False, 1), (True, 2)],
                         ids=["one-local-unit", "plus-unit-process"])
def test_every_row_reaches_every_task_exactly_once_with_unchanged_bytes(remote_unit, consumers_per_task):
    ctx = _context()
    deadline = time.monotonic() + DEADLINE_S
    svc = TransferQueueService(TransferQueueConfig(wait_timeout_s=60.0)).start_in_thread()
    procs: list = []
    client = None
    ok = False
    try:
        addr = svc.controller_address
        if remote_unit:
            ready = ctx.Event()
            unit = ctx.Process(target=H.storage_unit_main, args=(addr, 1, ready), daemon=True)
            unit.start()
            procs.append(unit)
            assert ready.wait(60), "the storage unit process did not register with the controller"
        client = TransferQueueClient(addr, timeout=30, wait_timeout=30)
        client.create_partition("stream", tasks=list(TASKS))
        out = ctx.Queue()

        consumers = []
        for t, (task, cols) in enumerate(TASKS.items()):
            n = consumers_per_task if task == "ref" else 1
            for j in range(n):
                consumers.append(ctx.Process(target=H.consumer_main,
                                             args=(addr, "stream", task, cols, 100 + 10 * t + j, out), daemon=True))
        half = N_ROWS // 2
        producers = [
            ctx.Process(target=H.producer_main, args=(addr, "stream", list(range(half)), 1, out), daemon=True),
            ctx.Process(target=H.producer_main, args=(addr, "stream", list(range(half, N_ROWS)), 2, out),
                        daemon=True),
        ]
        for p in consumers + producers:  # consumers first: they wait in get_meta for the first rows
            p.start()
            procs.append(p)

        # Collect reports; the first failure ends the test (the finally block kills the rest).
        reports = []
        done_producers = 0
        while done_producers < len(producers):
            r = _get(out, deadline, "producers")
            assert r[3] is None, f"{r[0]} ({r[1]}) failed:\n{r[3]}"
            reports.append(r)
            done_producers += r[0] == "producer"
        client.close_partition("stream")  # end of stream: consumers drain, then stop
        while sum(1 for r in reports if r[0] == "consumer") < len(consumers):
            r = _get(out, deadline, "consumers")
            assert r[3] is None, f"consumer of task {r[1]!r} failed: {r[3]}"
            reports.append(r)

        key_of_row = {row: key for kind, _, pairs, _, _ in reports if kind == "producer" for row, key in pairs}
        assert sorted(key_of_row.values()) == list(range(N_ROWS))
        rows_by_task: dict[str, list[int]] = collections.defaultdict(list)
        for kind, task, pairs, _, _ in reports:
            if kind != "consumer":
                continue
            wrong = [(row, key) for row, key in pairs if key_of_row.get(row) != key]
            assert not wrong, f"task {task!r}: data of other rows came back for rows {wrong[:5]}"
            rows_by_task[task] += [row for row, _ in pairs]
        for task in TASKS:
            seen = collections.Counter(rows_by_task[task])
            twice = [key_of_row[r] for r, c in seen.items() if c > 1]
            missing = sorted(key_of_row[r] for r in set(key_of_row) - set(seen))
            assert not twice, f"task {task!r}: rows consumed more than once (keys {twice[:10]})"
            assert not missing, f"task {task!r}: rows never consumed (keys {missing[:10]})"

        st = client.status("stream")
        assert st["rows"] == N_ROWS
        assert st["consumed"] == dict.fromkeys(TASKS, N_ROWS)
        assert st["column_rows"]["score"] == N_ROWS
        stats = client.unit_stats()
        assert sum(s["rows"] for s in stats) == N_ROWS
        if remote_unit:  # rows were spread over both units, so reads crossed units
            assert sorted(s["unit"] for s in stats) == [0, 1]
            assert all(s["rows"] > 0 for s in stats), stats
            assert sum(r[4] for r in reports) > 0, "no batch mixed rows of both units"
        assert client.clear("stream") == N_ROWS
        assert all(s["rows"] == 0 and s["bytes"] == 0 for s in client.unit_stats())
        ok = True
    finally:
        if client is not None:
            client.close()
        if remote_unit and procs:
            procs[0].terminate()  # the unit serves until stopped
        _stop(procs, 10.0 if ok else 0.5)
        svc.stop_in_thread()
