"""The CPU cost of message authentication (auth.seal + auth.unseal) on the messages the
benchmarks move: a small RPC call and a TransferQueue put of the bench_transfer_queue
payload (1024 rows, 5.6 MB), with the default coverage (header, lengths, frames up to
64 KiB) and with every byte covered (ASYNCFLOW_MAC_ALL_FRAMES=1). In-process, no
sockets, so it is steadier than the end-to-end benches on a shared machine. The last line
is one JSON object.

    PYTHONPATH=. python perf/bench_auth.py
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncflow.rpc import auth, codec


def _per_call_us(fn, min_s: float = 0.5) -> float:
    n, t0 = 0, time.perf_counter()
    while (el := time.perf_counter() - t0) < min_s:
        fn()
        n += 1
    return el / n * 1e6


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_transfer_queue import COLUMNS, make_payload, payload_bytes

    p = make_payload()
    cols = {k: ({"values": p[k].values(), "offsets": p[k].offsets()} if p[k].is_nested else p[k]) for k in COLUMNS}
    messages = {
        "rpc call (echo)": codec.encode({"id": 1, "m": "call", "a": {"role": "bench", "fn": "echo",
                                                                       "args": [{"i": 1}], "kwargs": {}}}),
        f"tq put ({payload_bytes(p) / 1e6:.1f} MB)": codec.encode({"id": 1, "m": "put",
                                                                   "a": {"partition": "p", "columns": cols}}),
    }
    nonce = auth.nonce_of(1, 1)
    rows, out = [], {}
    for name, frames in messages.items():
        for all_frames in (False, True):
            auth.set_cover_all(all_frames)
            assert auth.unseal(auth.REQUEST, auth.seal(auth.REQUEST, nonce, frames))[0] == nonce
            us = _per_call_us(lambda frames=frames: auth.unseal(auth.REQUEST, auth.seal(auth.REQUEST, nonce, frames)))
            rows.append((name, "every byte" if all_frames else "default", us))
            out[f"{name.split(' (')[0].replace(' ', '_')}_{'all' if all_frames else 'default'}_us"] = round(us, 1)
    auth.set_cover_all(False)
    print(f"{'message':22} {'coverage':>11} {'seal+unseal us':>15}")
    for name, cov, us in rows:
        print(f"{name:22} {cov:>11} {us:15.1f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
