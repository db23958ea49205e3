"""A process that does not know the run key sends well-formed messages with real method
names to every endpoint of a running cluster (worker call and control endpoints, the
TransferQueue controller and its storage unit): nothing is executed, nothing changes,
every message is counted, and the run goes on."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

import _sc_workers as W
import pytest
import torch
import zmq
import zmq.asyncio
from _sc_cluster import start_cluster, stop_cluster

from asyncflow.single_controller.runtime import split_address


def stranger_main(workers: list[str], controller: str, unit: str, out) -> None:
    """Sends every attack twice: signed with a key of its own, and untagged (the old
    protocol). Reports how many replies came back (none should)."""
    from asyncflow.rpc import auth, codec
    from asyncflow.rpc.async_client import RpcClient
    from asyncflow.rpc.errors import RpcTimeout

    os.environ.pop(auth.ENV_VAR, None)  # a stranger: it never saw the run's key
    auth.set_run_key(auth.generate_key(), export_env=False)
    rows = torch.arange(4)
    attacks: list[tuple[str, str, dict]] = [
        (controller, "clear", {"partition": "p"}),
        (controller, "create_partition", {"partition": "evil"}),
        (controller, "register_unit", {"index": 7, "address": "tcp://127.0.0.1:9"}),
        (controller, "clear_rows", {"partition": "p", "rows": rows}),
        (unit, "put", {"partition": "p", "columns": {"x": torch.zeros(4, dtype=torch.long)}}),
        (unit, "drop_partition", {"partition": "p"}),
    ]
    for address in workers:
        calls, control = split_address(address)
        attacks += [
            (calls, "call", {"role": "echo", "fn": "count_zero", "args": [], "kwargs": {}}),
            (calls, "shutdown", {}),
            (control, "exit_now", {}),
            (control, "set_transfer_queue", {"address": "tcp://127.0.0.1:9"}),
        ]

    async def signed() -> int:
        ctx = zmq.asyncio.Context()
        answered = 0

        async def one(address: str, method: str, args: dict) -> None:
            nonlocal answered
            c = RpcClient(address, ctx, timeout=1.0)
            try:
                await c.call(method, **args)
                answered += 1
            except RpcTimeout:
                pass
            except Exception:  # noqa: BLE001 - any reply at all is a failure of the test
                answered += 1
            finally:
                await c.close()
        await asyncio.gather(*(one(*a) for a in attacks))
        ctx.destroy(linger=0)
        return answered

    def untagged() -> int:
        ctx = zmq.Context()
        socks = []
        for i, (address, method, args) in enumerate(attacks):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            s.send_multipart(codec.encode({"id": i, "m": method, "a": args}), copy=False)
            socks.append(s)
        time.sleep(1.0)
        answered = sum(1 for s in socks if s.poll(0, zmq.POLLIN))
        ctx.destroy(linger=0)
        return answered

    try:
        out.put({"sent": len(attacks), "answered": asyncio.run(signed()) + untagged(), "error": None})
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        out.put({"sent": len(attacks), "answered": -1, "error": repr(e)})


@pytest.mark.slow
@pytest.mark.both_stacks
def test_a_stranger_changes_nothing_and_the_run_goes_on():
    c = start_cluster(2)
    try:
        d = c.driver
        echo = c.run(d.create_group(W.EchoWorker, "echo"))
        tq = c.tq_client()

        async def fill():
            await tq.create_partition("p")
            await tq.put({"x": torch.arange(8)}, "p")
            return await tq.status("p")
        before = c.run(fill())
        units_before = dict(c.tq.controller.unit_addresses)
        unit_address = next(iter(units_before.values()))

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=stranger_main, args=(d.addresses, c.tq.controller_address, unit_address, out),
                        daemon=True)
        p.start()
        res = out.get(timeout=60)
        p.join(10)
        assert res["error"] is None, res["error"]
        assert res["answered"] == 0, "a message without the run key got a reply"
        time.sleep(0.5)  # exit_now, had it run, would have ended a worker by now

        # Nothing executed, nothing changed ...
        assert c.run(tq.status("p")) == before
        assert c.run(tq.status())["partitions"] == ["p"]
        assert c.tq.controller.unit_addresses == units_before
        assert c.run(echo.zero_calls_seen()) == [0, 0]
        # ... every message was counted where it arrived ...
        per_rank = 4 * 2  # four attacks per rank, signed and untagged

        async def pings():
            return await asyncio.gather(*(ep.ping(5.0) for ep in d.ranks))
        infos = c.run(pings())
        assert [i["auth_failures"] for i in infos] == [per_rank] * 2
        servers = c.tq._servers
        assert servers[0].auth_failures == 4 * 2  # the controller
        assert servers[1].auth_failures == 2 * 2  # its storage unit
        assert all(s.bad_messages == 0 for s in servers)
        # ... and the run goes on: workers alive, calls and the TransferQueue work.
        d.check()
        assert c.run(echo.count_zero()) == 0
        assert c.run(echo.zero_calls_seen()) == [1, 0]

        async def read():
            meta = await tq.get_meta(["x"], 8, "t", "p")
            cols = await tq.get_columns(meta)
            await tq.close()
            return cols["x"].data.tolist()
        assert sorted(c.run(read())) == list(range(8))
    finally:
        stop_cluster(c)
