"""RuntimeConfig.collective_timeout_s reaches the worker groups' process groups: a collective
that one rank enters alone fails after that timeout, with an error naming the method, the
rank and the timeout, instead of hanging until the driver's call timeout."""
from __future__ import annotations

from dataclasses import replace

import _dp_workers as D
import pytest
from _sc_cluster import FAST_DRIVER

from asyncflow.rpc.loop_thread import EventLoopThread
from asyncflow.single_controller import Driver, LaunchConfig, RuntimeConfig, WorkerError
from asyncflow.single_controller.local import LocalWorkers

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

# Also init_process_group's and new_group's timeout: enough for two ranks that start
# together to meet even on a loaded 2-core machine, short enough to see it beat the call's.
COLLECTIVE_TIMEOUT_S = 5.0


def test_collective_entered_by_one_rank_times_out():
    # The driver would wait 20 s for the reply: a failure sooner is the collective's timeout.
    cfg = LaunchConfig(platform="cpu", rendezvous_timeout_s=60.0, transfer_queue=False,
                    runtime=RuntimeConfig(collective_timeout_s=COLLECTIVE_TIMEOUT_S, driver_timeout_s=10.0,
                                          attach_timeout_s=60.0))
    driver_cfg = replace(FAST_DRIVER, call_timeout_s=20.0)
    workers = LocalWorkers(2, cfg)
    loop = EventLoopThread("test-driver")
    try:
        driver = Driver(workers.addresses, config=driver_cfg)
        loop.run(driver.start(), timeout=60)
        wg = loop.run(driver.create_group(D.DpWorker, "c", ranks=[1, 0]), timeout=60)  # rank 1 first
        with pytest.raises(WorkerError) as ei:
            loop.run(wg.lonely_reduce(), timeout=30)  # only the group's first rank (1) is called
        msg = str(ei.value)
        assert "c.lonely_reduce failed on rank 1" in msg, msg
        assert ei.value.rank == 1 and ei.value.method == "c.lonely_reduce"
        # gloo names the timeout it waited
        assert f"{COLLECTIVE_TIMEOUT_S * 1000:.0f}ms" in msg and "Timed out" in msg, msg
        assert loop.run(wg.whoami(), timeout=10) == [1, 0]  # both ranks still serve calls
        loop.run(driver.shutdown(), timeout=30)
    finally:
        loop.stop()
        workers.close(timeout=15)
    assert workers.join(0) == [0, 0]  # a clean shutdown: nothing left hanging
