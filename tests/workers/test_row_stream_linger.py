"""The rollout stream's writer (RowStream): rows of one call finishing apart go into the
TransferQueue together once the call is complete, a finished row waits at most ``linger_s``
for the rest, and with no linger each row goes out as it finishes. A fake service hands the
results back when the test says; a fake TransferQueue records the puts."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncflow.engines.rollout.base import RequestResult, SamplingParams
from asyncflow.transfer_queue.meta import BatchMeta
from asyncflow.workers.rollout_stream import RowStream

WAIT_S = 10.0  # every wait of the test: far above what the writer needs


class _Service:
    """Records each request's callback; the test finishes requests one by one."""

    busy_s = 0.0

    def __init__(self) -> None:
        self.done: list = []

    def submit(self, req, on_done) -> None:
        self.done.append(on_done)

    def check(self) -> None:
        pass


class _TQ:
    def __init__(self, n: int) -> None:
        self.n = n
        self.puts: list[tuple[float, list[int]]] = []  # (when, the rows' ids)
        self.cond = threading.Condition()

    def get_columns(self, meta, inputs):
        return {"prompt_ids": [torch.tensor([5, 6])] * self.n, "seed": torch.arange(self.n)}

    def put(self, cols, partition, meta) -> None:
        assert len(cols["response_ids"]) == len(meta)
        with self.cond:
            self.puts.append((time.monotonic(), list(meta.rows)))
            self.cond.notify_all()

    def wait_rows(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(len(r) for _, r in self.puts) >= n, WAIT_S), self.puts


def _stream(n: int, linger_s: float) -> tuple[RowStream, _Service, _TQ]:
    service, tq = _Service(), _TQ(n)
    stream = RowStream(service, lambda: tq, SamplingParams(max_new_tokens=4), capacity=64, version=lambda: 0,
                       name="rollout-test", linger_s=linger_s)
    meta = BatchMeta("step_0", list(range(100, 100 + n)), ["prompt_ids", "seed"], groups=[0] * n)
    stream.submit(meta, 0)
    assert len(service.done) == n
    return stream, service, tq


def _finish(service: _Service, i: int) -> None:
    service.done[i](RequestResult(i, torch.tensor([7, 1]), torch.zeros(2), torch.zeros(2, dtype=torch.long), "stop"))


def test_rows_of_a_call_finishing_apart_share_one_put_written_when_the_last_finishes():
    stream, service, tq = _stream(4, linger_s=WAIT_S)
    try:
        for i in (2, 0, 3):
            _finish(service, i)
            time.sleep(0.02)
        time.sleep(0.1)
        assert tq.puts == [], "no row goes out while its call still generates, within the linger"
        start = time.monotonic()
        _finish(service, 1)
        tq.wait_rows(4)
        assert len(tq.puts) == 1 and tq.puts[0][1] == [100, 101, 102, 103]  # in the call's row order
        assert tq.puts[0][0] - start < WAIT_S / 2, "the complete call is written at once, not after the linger"
        stream.drain(WAIT_S)  # the writer counts its rows out after the put returns
        assert stream.in_flight == 0 and stream.rows_written == 4
    finally:
        stream.close()


def test_a_finished_row_waits_at_most_the_linger_for_a_straggler():
    linger = 0.5
    stream, service, tq = _stream(3, linger_s=linger)
    try:
        start = time.monotonic()
        _finish(service, 0)
        _finish(service, 1)
        tq.wait_rows(2)  # row 2 never finishes meanwhile: the two go out after the linger
        assert [r for _, r in tq.puts] == [[100, 101]]
        assert linger <= tq.puts[0][0] - start < WAIT_S / 2
        _finish(service, 2)
        tq.wait_rows(3)
        assert [r for _, r in tq.puts] == [[100, 101], [102]]
    finally:
        stream.close()


def test_without_a_linger_each_row_goes_out_as_it_finishes():
    stream, service, tq = _stream(3, linger_s=0.0)
    try:
        for i in range(3):
            _finish(service, i)
            tq.wait_rows(i + 1)
        assert [r for _, r in tq.puts] == [[100], [101], [102]]
    finally:
        stream.close()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_linger_is_refused_by_the_stream_and_by_the_config(bad):
    from asyncflow.config import load_config
    with pytest.raises(ValueError, match="linger_s must be a finite number >= 0"):
        RowStream(_Service(), lambda: _TQ(1), SamplingParams(), capacity=4, version=lambda: 0, linger_s=bad)
    with pytest.raises(ValueError, match="rollout.write_linger_s: must be a finite number >= 0"):
        load_config(None, [f"rollout.write_linger_s={bad}"])
