"""Run one TransferQueue storage unit as its own process (one per node):

    python -m asyncflow.transfer_queue.unit_process --controller tcp://HOST:PORT --index 1 --host HOST

It registers with the controller and serves until killed. A module of its own so that
``python -m`` does not find it already imported by the package.
"""
from __future__ import annotations

import argparse
import asyncio

from .service import serve_storage_unit


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run one TransferQueue storage unit process.")
    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://10.0.0.1:5555")
    p.add_argument("--index", type=int, required=True, help="unit index, unique in the run")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    a = p.parse_args(argv)
    asyncio.run(serve_storage_unit(a.controller, a.index, a.host, a.max_rows, a.max_bytes))


if __name__ == "__main__":
    main()
