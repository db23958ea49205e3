"""A local launcher that keeps the run going when a replaceable rank dies, and starts a new
process for it when the driver asks.

torch's elastic launcher (``launch.launch_local``, torchrun) stops every rank as soon as
one exits. Here this process starts the ranks itself (spawned children, the store hosted
here, as ``LocalWorkers`` does) and watches them:

- rank 0 (the driver) ends the run: its exit code is the run's, and the other ranks are
  stopped (SIGTERM, then SIGKILL after ``stop_grace_s``);
- another rank that dies stops the run the same way, unless the driver marked it
  replaceable (key ``asyncflow/fault/replaceable/<rank>``, a rollout instance's rank);
- the driver asks for a rank's ``n``-th new process by setting ``asyncflow/fault/restart/<rank>``
  to ``n``: the old process is killed if it still lives (a hung one), and a new one starts
  with ``restart=n``; it publishes its address under ``rendezvous.address_key(rank, n)``.
"""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .errors import LaunchError
from .launch import FAILURE_FILE_ENV, run_rank
from .rendezvous import KEY_PREFIX, SUPERVISED_ENV, address_key

RESTART_ENV = "ASYNCFLOW_RESTART"  # in a rank's process: which new process of its rank it is (0: the first)
REPLACEABLE_KEY = KEY_PREFIX + "fault/replaceable/"
RESTART_KEY = KEY_PREFIX + "fault/restart/"
EXIT_KEY = KEY_PREFIX + "fault/exit/"  # how a replaceable rank's last process ended, for the driver's report


def under_elastic_agent_problem(rollout_restarts: bool, environ: Mapping[str, str]) -> str | None:
    """Why a run that replaces lost rollout instances cannot start under torchrun (or any
    torch elastic agent: RANK is set in the environment), or None. The agent owns the rank
    processes and stops every rank, then restarts the whole group or ends the job, as soon
    as one exits; a lost instance's process is killed (a hung one too, so that no late row
    comes from it), so no new process could ever join the run beside the others."""
    if not rollout_restarts or "RANK" not in environ:
        return None
    return ("fault.rollout_restarts=true cannot run under torchrun: torch's elastic agent stops every rank as "
            "soon as one rank's process exits, so a lost rollout instance cannot be replaced while the others "
            "go on. Start the run with `asyncflow train ...` itself (its own launcher starts the ranks and "
            "replaces a lost instance; one node), or leave fault.rollout_restarts=false under torchrun "
            "(a rank's death then stops the run; trainer.resume=auto goes on from the last checkpoint)")


def mark_replaceable(store: Any, rank: int) -> None:
    """The driver's side: ``rank``'s death does not stop the run."""
    store.set(f"{REPLACEABLE_KEY}{rank}", "1")


def request_restart(store: Any, rank: int, restart: int) -> None:
    """The driver's side: start the ``restart``-th new process of ``rank`` (killing the old one)."""
    store.set(f"{RESTART_KEY}{rank}", str(int(restart)))


def last_exit(store: Any, rank: int) -> str:
    """How ``rank``'s last process ended, as this launcher saw it ("" if it has not said)."""
    key = f"{EXIT_KEY}{rank}"
    return store.get(key).decode() if store.check([key]) else ""


def wait_restarted(store: Any, rank: int, restart: int, timeout_s: float) -> str:
    """The address the ``restart``-th new process of ``rank`` published (blocking: run it off
    the event loop); TimeoutError naming the rank when it does not come within ``timeout_s``."""
    key = address_key(rank, restart)
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the new process of rank {rank} (restart {restart}) did not publish its address "
                               f"within {timeout_s:.0f}s")
        time.sleep(0.1)
    return str(store.get(key).decode())


def _rank_main(cfg: Any, rank: int, world_size: int, port: int, env: dict[str, str], restart: int) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is a stuck rank?
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    code = run_rank(cfg, rank, world_size, rank, "127.0.0.1", port, use_agent_store=True, with_driver=rank == 0,
                    restart=restart)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class _Ranks:
    """The rank processes of one run, each replaceable by a new one."""

    def __init__(self, cfg: Any, nproc: int, env: dict[str, str]):

        # every rank exits when this launcher is gone (the worker runtime's watchdog), rank 0 too
        self.cfg = replace(cfg, runtime=replace(cfg.runtime, parent_pid=os.getpid()))
        self.nproc = nproc
        self.store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        self.env = {**env, SUPERVISED_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = [None] * nproc
        self.restarts = [0] * nproc
        self.gone: set[int] = set()  # replaceable ranks whose process died, not yet restarted
        for r in range(nproc):
            self.start(r, 0)

    def start(self, rank: int, restart: int) -> None:
        env = {**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank), RESTART_ENV: str(restart)}
        p = self.ctx.Process(target=_rank_main, args=(self.cfg, rank, self.nproc, self.store.port, env, restart),
                             name=f"asyncflow-rank{rank}" + (f"-restart{restart}" if restart else ""), daemon=False)
        p.start()
        self.procs[rank] = p
        self.restarts[rank] = restart

    def replaceable(self, rank: int) -> bool:
        return self.store.check([f"{REPLACEABLE_KEY}{rank}"])

    def wanted_restart(self, rank: int) -> int:
        key = f"{RESTART_KEY}{rank}"
        return int(self.store.get(key).decode()) if self.store.check([key]) else 0

    def stop_all(self, grace_s: float) -> None:
        live = [p for p in self.procs if p is not None and p.exitcode is None]
        for p in live:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in live:
            if p.exitcode is None:
                p.kill()
                p.join(5)


def launch_supervised(cfg: Any, nproc: int, *, describe_rank: Callable[[int], str] | None = None,
                      poll_s: float = 0.2, stop_grace_s: float = 30.0, env: dict[str, str] | None = None) -> int:
    """Run ``nproc`` local ranks (rank 0 the driver) until rank 0 exits; returns its exit code
    (non-zero, with the dead rank named, when a rank that is not replaceable died first)."""

    failure = Path(tempfile.mkdtemp(prefix="asyncflow-launch-")) / "driver_failure.txt"
    ranks = _Ranks(cfg, nproc, {**(env or {}), FAILURE_FILE_ENV: str(failure)})
    interrupted: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            time.sleep(poll_s)
            if interrupted:
                name = signal.Signals(interrupted[0]).name
                ranks.stop_all(stop_grace_s)
                print(f"asyncflow run interrupted: this launcher got {name} and stopped its {nproc} ranks",
                      file=sys.stderr, flush=True)
                return 128 + interrupted[0]
            driver = ranks.procs[0]
            if driver.exitcode is not None:
                if driver.exitcode == 0:  # the others were told to shut down: let them finish their teardown
                    deadline = time.monotonic() + stop_grace_s
                    for p in ranks.procs:
                        p.join(max(0.0, deadline - time.monotonic()))
                ranks.stop_all(stop_grace_s)
                if driver.exitcode:
                    cause = f"\nasyncflow run failed: the driver's error: {failure.read_text()}" \
                        if failure.is_file() else ""
                    print(f"asyncflow run failed: rank 0 (the driver) {_how(driver.exitcode)}{cause}",
                          file=sys.stderr, flush=True)
                    return 1
                return 0
            for r in range(1, nproc):
                p = ranks.procs[r]
                want = ranks.wanted_restart(r)
                if want > ranks.restarts[r]:  # the driver asks for a new process (a hung one is killed first)
                    if p.exitcode is None:
                        p.kill()
                        p.join(10)
                    ranks.gone.discard(r)
                    ranks.start(r, want)
                    continue
                if p.exitcode is None or p.exitcode == 0 or r in ranks.gone:
                    continue  # running, or done serving (the driver ends the run)
                if ranks.replaceable(r):
                    ranks.gone.add(r)
                    ranks.store.set(f"{EXIT_KEY}{r}", f"its process {_how(p.exitcode)} (pid {p.pid})")
                    print(f"asyncflow: rank {r} {_how(p.exitcode)} (pid {p.pid}); it is replaceable, the run goes "
                          f"on", file=sys.stderr, flush=True)
                    continue
                who = describe_rank(r) if describe_rank is not None else ""
                ranks.stop_all(stop_grace_s)
                cause = (f"\nasyncflow run failed: the driver's error: {failure.read_text()}"
                         if failure.is_file() else "")
                print(f"asyncflow run failed: rank {r}{f' ({who})' if who else ''} {_how(p.exitcode)} (pid {p.pid})"
                      f"{cause}", file=sys.stderr, flush=True)
                return 1
    except LaunchError:
        ranks.stop_all(stop_grace_s)
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(failure.parent, ignore_errors=True)
