"""Run one TransferQueue storage unit as its own process (one per node):

    python -m asyncflow.transfer_queue.unit_process --controller tcp://HOST:PORT --index 1 --host HOST \
        --store MASTER_ADDR:MASTER_PORT

It registers with the controller and serves until killed. A module of its own so that
``python -m`` does not find it already imported by the package.

The unit signs and checks every message with the run's key (``auth``), which is never
passed on the command line (other users can read that): it is read from torchrun's
TCPStore (``--store``, where rank 0 put it), or else from ``ASYNCFLOW_RUN_KEY`` (hex) in
the environment, as a process started by a rank inherits it. Without either it refuses
to start: a unit with a key of its own could talk to nobody.
"""
from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta

import torch
import torch.distributed as dist

from ..rpc import auth
from ..rpc.alloc import freeze_gc_heap, keep_freed_memory
from .service import serve_storage_unit


def key_from_store(address: str, timeout_s: float) -> bytes:
    """The run key under ``auth.STORE_KEY`` in the TCPStore at ``HOST:PORT``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"--store {address!r}: expected HOST:PORT of torchrun's store (MASTER_ADDR:MASTER_PORT)")
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except Exception as e:  # say which store could not be reached
        raise SystemExit(f"cannot reach the TCPStore at {address} within {timeout_s:.0f}s: {e}") from e
    try:
        return auth.wait_key_in_store(store, timeout_s, f"storage unit (store {address})")
    except TimeoutError as e:
        raise SystemExit(str(e)) from None


def prepare_unit_process() -> None:
    """Set up a process that only stores: it reuses the memory of cleared messages and keeps its
    imports out of every garbage collection (alloc.py), and runs tensor ops on one thread: its
    ops are small copies and gathers, where intra-op threads only add wake-ups (and spin on the
    cores of the workers beside it)."""
    keep_freed_memory()
    freeze_gc_heap()
    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run one TransferQueue storage unit process.")
    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://10.0.0.1:5555")
    p.add_argument("--index", type=int, required=True, help="unit index, unique in the run")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--store", default=None,
                   help=f"HOST:PORT of torchrun's TCPStore to read the run key from (else ${auth.ENV_VAR})")
    p.add_argument("--store-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.store:
        auth.set_run_key(key_from_store(a.store, a.store_timeout))
    elif auth.key_source() == "generated":  # nothing inherited: the key made at import is ours alone
        raise SystemExit(f"no run key: pass --store MASTER_ADDR:MASTER_PORT, or set {auth.ENV_VAR} (hex) in the "
                         "environment; a unit with a key of its own would drop every message of the run")
    prepare_unit_process()
    asyncio.run(serve_storage_unit(a.controller, a.index, a.host, a.max_rows, a.max_bytes))


if __name__ == "__main__":
    main()
