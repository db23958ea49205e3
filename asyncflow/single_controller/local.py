"""Worker ranks as child processes of this one, with the driver here: for tests,
benchmarks and notebooks. The rendezvous is the same as under torchrun (this process
hosts the TCPStore); only who starts the processes differs.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from ..rpc import auth
from .errors import LaunchError
from .launch import LaunchConfig, run_rank
from .rendezvous import wait_addresses


def _child(cfg: LaunchConfig, rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is a stuck rank?
    os.environ.update(env)
    code = run_rank(cfg, rank, world_size, rank, "127.0.0.1", port, use_agent_store=True, with_driver=False)
    os._exit(code)


@dataclass
class LocalWorkers:
    """``with LocalWorkers(2) as w: Driver(w.addresses, ...)``; every rank is a worker."""

    world_size: int
    config: LaunchConfig = field(default_factory=lambda: LaunchConfig(platform="cpu"))
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})

    def __post_init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        # The driver (and any TransferQueue) lives here: the ranks take this process's key.
        self.store.set(auth.STORE_KEY, auth.run_key())  # type: ignore[arg-type]  # (stub: str; takes bytes)
        ctx = mp.get_context("spawn")
        # The ranks exit as soon as this process is gone, even before any driver pings them
        # (else they would wait out runtime.attach_timeout_s as orphans). A parent-pid check in
        # their watchdog rather than PR_SET_PDEATHSIG: that fires when the starting *thread*
        # exits (this may be a short-lived thread of a live process) and is Linux-only.
        cfg = replace(self.config, runtime=replace(self.config.runtime, parent_pid=os.getpid()))
        self.procs = [ctx.Process(target=_child, args=(cfg, r, self.world_size, self.store.port, self.env),
                                  name=f"asyncflow-rank{r}", daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        try:
            self.addresses = wait_addresses(self.store, self.world_size, self.config.rendezvous_timeout_s,
                                            self._check_alive)
        except BaseException:
            self.close()
            raise

    def _check_alive(self) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            raise LaunchError(f"worker ranks exited during start-up (rank, exit code): {dead}; see their output")

    def kill(self, rank: int) -> None:
        pid = self.procs[rank].pid
        if pid is None:  # started in __post_init__: never None here
            raise LaunchError(f"rank {rank} has no process to kill")
        os.kill(pid, signal.SIGKILL)

    def join(self, timeout: float) -> list[int | None]:
        """Exit codes after waiting up to ``timeout`` seconds in all (None: still running)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [p.exitcode for p in self.procs]

    def close(self, timeout: float = 10.0) -> None:
        self.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
