"""Failures: a worker killed mid-call is reported within 10 s naming its rank and role;
workers exit when the driver's heartbeat stops (no orphans)."""
from __future__ import annotations

import asyncio
import time

import pytest

from asyncflow.single_controller import PlacementConfig, WorkerDiedError

import _sc_workers as W
from _sc_cluster import start_cluster, stop_cluster

pytestmark = pytest.mark.slow


def test_worker_killed_mid_call_is_reported_fast():
    placement = PlacementConfig("disaggregated", roles={"gen": [0], "train": [1]})
    c = start_cluster(2, placement)
    try:
        d = c.driver

        async def go():
            gen = await d.create_group(W.EchoWorker, "gen")
            train = await d.create_group(W.EchoWorker, "train")
            assert (gen.ranks, train.ranks) == ([0], [1])
            call = asyncio.ensure_future(train.sleep(60.0))
            other = asyncio.ensure_future(d.run(gen.sleep(60.0)))  # the run stops too, not only the call
            await asyncio.sleep(0.5)
            c.workers.kill(1)
            t0 = time.monotonic()
            results = await asyncio.gather(call, other, return_exceptions=True)
            return time.monotonic() - t0, results
        waited, (err_call, err_run) = c.run(go(), timeout=30)
        assert waited < 10.0
        for err in (err_call, err_run):
            assert isinstance(err, WorkerDiedError), repr(err)
            assert "rank 1" in str(err) and "train" in str(err)
        assert "train.sleep on rank 1" in str(err_call)
        with pytest.raises(WorkerDiedError):
            d.check()
    finally:
        stop_cluster(c)
    assert c.workers.join(0) == [4, -9]  # rank 0 told to exit at once (it was mid-call); rank 1 SIGKILLed


def test_workers_exit_when_driver_heartbeat_stops():
    c = start_cluster(2, driver_timeout_s=2.0)
    try:
        c.run(c.driver.stop_heartbeats())  # pings stop without a shutdown, as when the driver process dies
        t0 = time.monotonic()
        codes = c.workers.join(15)
        assert codes == [3, 3], codes
        assert time.monotonic() - t0 < 8
    finally:
        stop_cluster(c)
