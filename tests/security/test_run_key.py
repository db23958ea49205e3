"""The run key: agreed through the TCPStore, installed before any socket, never on a
command line; the replay window's bookkeeping."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from asyncflow.rpc import auth
from asyncflow.single_controller.errors import LaunchError
from asyncflow.single_controller.rendezvous import share_run_key, wait_run_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh_key(monkeypatch):
    """This process as if no key had been made yet; restored afterwards."""
    monkeypatch.setattr(auth, "_key", None)
    monkeypatch.setattr(auth, "_key_used", False)
    monkeypatch.setattr(auth, "_key_source", "")
    monkeypatch.delenv(auth.ENV_VAR, raising=False)


def _store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def test_rank0_makes_the_key_and_every_rank_gets_the_same(fresh_key):
    store = _store()
    got = {}

    def rank(r):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        got[r] = share_run_key(client, r, 10) if r == 0 else wait_run_key(client, 10, f"rank {r}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # others wait for rank 0
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(got[0]) == auth.KEY_BYTES and got[0] == got[1] == got[2]
    assert auth.run_key() == got[0]  # installed here (rank 0's call)
    assert os.environ[auth.ENV_VAR] == got[0].hex()  # children of this rank inherit it


def test_a_key_already_in_the_store_wins(fresh_key):
    store = _store()
    mine = auth.generate_key()
    store.set(auth.STORE_KEY, mine)  # as LocalWorkers does for the driver's process
    assert share_run_key(store, 0, 5) == mine


def test_waiting_for_the_key_times_out_naming_it(fresh_key):
    with pytest.raises(LaunchError, match=r"rank 3: the run key \('asyncflow/run_key'\) did not appear"):
        share_run_key(_store(), 3, 0.2)


def test_the_key_cannot_change_after_use(fresh_key):
    first = auth.run_key()  # generated for this process
    auth.set_run_key(first)  # the same key again is fine
    with pytest.raises(auth.AuthError, match="changed after messages were signed"):
        auth.set_run_key(auth.generate_key())
    with pytest.raises(auth.AuthError, match="32 bytes"):
        auth.set_run_key(b"short")


def test_a_key_from_the_environment_is_used(fresh_key, monkeypatch):
    key = auth.generate_key()
    monkeypatch.setenv(auth.ENV_VAR, key.hex())
    assert auth.run_key() == key
    monkeypatch.setenv(auth.ENV_VAR, "zz")
    with pytest.raises(auth.AuthError, match="hex digits"):
        auth.key_from_env()


def test_replay_window():
    w = auth.ReplayWindow(size=8, max_senders=2)
    n = auth.nonce_of
    assert w.accept(n(1, 5)) and not w.accept(n(1, 5))
    assert w.accept(n(1, 3)) and w.accept(n(1, 9)) and not w.accept(n(1, 3))
    assert not w.accept(n(1, 1))  # older than the window: refused
    assert w.accept(n(1, 2)) is True  # 9 - 2 = 7 < 8: still inside, not seen
    assert w.accept(n(1, 100)) and w.accept(n(1, 99)) and not w.accept(n(1, 100))
    assert w.accept(n(2, 0)) and w.accept(n(3, 0))  # sender 1 is forgotten (oldest)
    assert len(w._seen) == 2


@pytest.mark.slow
def test_a_storage_unit_process_without_a_key_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "asyncflow.transfer_queue.unit_process", "--controller",
                        "tcp://127.0.0.1:9", "--index", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "no run key" in p.stderr and "--store" in p.stderr
