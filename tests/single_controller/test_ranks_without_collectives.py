"""RuntimeConfig(collectives=False): many ranks in one process, no torch.distributed groups
(the simulated ranks of asyncflow.simulation); calls still cross the real RPC."""
from __future__ import annotations

import asyncio
import os
import threading

from _sc_workers import EchoWorker

from asyncflow.platform import get_platform
from asyncflow.single_controller import Driver
from asyncflow.single_controller.runtime import RuntimeConfig, WorkerRuntime


def test_ranks_share_a_process_and_serve_calls_without_process_groups():
    cfg = RuntimeConfig(collectives=False, attach_timeout_s=30)
    runtimes = [WorkerRuntime(r, 4, r, get_platform("cpu"), "127.0.0.1", cfg) for r in range(4)]
    for rt in runtimes:
        threading.Thread(target=rt.serve, daemon=True).start()

    async def main() -> tuple:
        async with Driver([rt.address for rt in runtimes]) as driver:
            group = await driver.create_group(EchoWorker, "echo", ranks=[0, 1, 2], tag="sim")
            await driver.make_group([0, 3])  # a weight-sync group: members get None, nothing is made
            return await group.whoami(7), await group.count_zero()

    try:
        who, zero = asyncio.run(main())
    finally:
        for rt in runtimes:
            rt.close()
    assert [w["rank"] for w in who] == [0, 1, 2]
    assert {w["pid"] for w in who} == {os.getpid()}  # one process hosts them all
    assert [w["dp_rank"] for w in who] == [0, 1, 2] and all(w["x"] == 7 and w["tag"] == "sim" for w in who)
    assert zero == 0
    assert runtimes[0].workers["echo"].process_group is None  # no communicator was made
    assert runtimes[0]._group_of([0, 3]) is None and runtimes[3]._group_of([0, 3]) is None
