"""Launch: every rank runs a worker; rank 0 also runs the driver.

    torchrun --nproc-per-node 2 -m asyncflow.single_controller.launch --main pkg.mod:main
    python -m asyncflow.single_controller.launch --nproc 2 --main pkg.mod:main   # self-launch

``main`` is ``async def main(driver: Driver, *main_args)``. Rank 0 runs it on an asyncio loop in its
main thread; rank 0's own worker serves on another thread and is reached through the
same RPC path as every other rank. Addresses travel through torchrun's TCPStore. The
process exits non-zero when ``main`` raises or a worker dies.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from ..platform import get_platform
from ..rpc.alloc import freeze_gc_heap
from ..transfer_queue import TransferQueueConfig, TransferQueueService
from .driver import Driver, DriverConfig
from .errors import LaunchError
from .placement import RolePlacement
from .rendezvous import SUPERVISED_ENV, connect_store, publish_address, rendezvous_host, share_run_key, wait_addresses
from .runtime import RuntimeConfig, WorkerRuntime
from .tq_units import (
    TransferQueueLayout,
    node_from_env,
    nodes_of_ranks,
    start_for_rank,
    wait_for_node_units,
    write_unit_stats,
)

log = logging.getLogger(__name__)


@dataclass
class LaunchConfig:
    main: str = ""  # "package.module:function", an async function taking the Driver
    # More arguments of ``main``, after the driver: ``main(driver, *main_args)``. They travel
    # inside this config, which is pickled into every spawned rank, so they must pickle.
    main_args: tuple[Any, ...] = ()
    platform: str = "auto"
    placement: RolePlacement = field(default_factory=RolePlacement)
    driver: DriverConfig = field(default_factory=DriverConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # Store connection, run key and address exchange. Not init_process_group's timeout: torch
    # makes that the timeout of every collective on the default group too, so it is
    # runtime.collective_timeout_s, as for the groups that new_group makes.
    rendezvous_timeout_s: float = 120.0
    transfer_queue: bool = True  # rank 0 starts the TransferQueue service and tells the workers
    # where the TransferQueue's service and units run, and their bounds (tq_units.py)
    tq_units: TransferQueueLayout = field(default_factory=TransferQueueLayout)
    # modules the service imports before serving, as every worker does (the run's imports:
    # samplers registered there are known to the controller wherever it runs)
    tq_imports: list[str] = field(default_factory=list)


def import_function(path: str) -> Callable[..., Any]:
    mod, _, name = path.partition(":")
    if not mod or not name:
        raise LaunchError(f"--main {path!r} must look like 'package.module:function'")
    fn: Callable[..., Any] = getattr(importlib.import_module(mod), name)
    return fn


def ranks_sharing_devices(spawning: int = 0) -> int:
    """How many ranks of this node see the same devices: ``spawning`` when this process is
    about to start them itself; under torch's elastic agent (torchrun, launch_local) its
    LOCAL_WORLD_SIZE, since the agent starts every local rank with one environment; 1
    otherwise (ranks started one by one, e.g. by srun, may each see a device of their own)."""
    if spawning:
        return spawning
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return 1


def run_rank(cfg: LaunchConfig, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
             *, use_agent_store: bool | None = None, with_driver: bool | None = None, node: int = 0,
             restart: int = 0) -> int:
    """Everything one rank does; returns the process exit code. ``node``: the node index.
    ``restart`` > 0: this is the rank's ``restart``-th new process, replacing a lost rollout
    instance: it joins no world process group (the world's other members made theirs with the
    old process; its groups are its own, and its weight-sync groups are made outside the world)
    and publishes its address under a key of its own, for the driver's ``replace_rank``."""


    _die_of_sigint()
    _thread_lock_for_progress_bars()

    platform = get_platform(cfg.platform, ranks_per_node=ranks_sharing_devices())
    platform.set_device(platform.device_for_local_rank(local_rank))
    store = connect_store(master_addr, master_port, rank, world_size, cfg.rendezvous_timeout_s, use_agent_store)
    share_run_key(store, rank, cfg.rendezvous_timeout_s)  # before any ZMQ socket: every message is signed
    runtime_cfg = cfg.runtime
    if restart:
        runtime_cfg = replace(cfg.runtime, collectives=False)
    else:
        dist.init_process_group(platform.backend, store=dist.PrefixStore("asyncflow/pg", store), rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=cfg.runtime.collective_timeout_s))
    host = rendezvous_host(master_addr)
    is_driver = with_driver if with_driver is not None else rank == 0
    # Before the address is published: a node's storage unit is registered by then.
    tq = start_for_rank(cfg.tq_units, store, rank, local_rank, node, host, cfg.rendezvous_timeout_s,
                        driver=is_driver, imports=cfg.tq_imports,
                        on_service_death=_stop_this_rank) if cfg.transfer_queue else None
    runtime = WorkerRuntime(rank, world_size, local_rank, platform, host, runtime_cfg)
    # A rank's process is ours: its import-time heap (torch, zmq, the TQ service on rank 0)
    # stays out of every later garbage collection, as in a storage unit's process.
    freeze_gc_heap()
    publish_address(store, rank, runtime.address, restart)
    code = 0
    try:
        if is_driver:
            serving = threading.Thread(target=runtime.serve, name="worker-rank0", daemon=True)
            serving.start()
            addresses = wait_addresses(store, world_size, cfg.rendezvous_timeout_s)
            nodes = nodes_of_ranks(store, world_size) if tq is not None else None
            code = asyncio.run(run_driver(cfg, addresses, host, tq.service if tq else None, nodes,
                                          report_sigterm=True,
                                          store=store if os.environ.get(SUPERVISED_ENV) else None))
            serving.join(timeout=30)
            if serving.is_alive():  # still inside a call: its socket must not be closed under it
                return code or 1
        else:
            runtime.serve()
    except BaseException:
        runtime.close()
        if tq is not None:
            tq.stop()
        raise
    runtime.close()
    if tq is not None:
        tq.stop()
    # after a failure a peer may be gone: just exit. A worker's teardown may have ended the group
    # already (vLLM's engine shutdown destroys the process's default group).
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


def _die_of_sigint() -> None:
    """A rank dies of Ctrl-C at once, as of the launcher's SIGTERM. A KeyboardInterrupt raised
    wherever the main thread happens to be would run the cleanup below while other threads still
    use their ZMQ sockets, and libzmq aborts the process on that ("Assertion failed: _term_acks >
    0"). Nothing is lost by dying: checkpoints are committed whole or not at all, the
    TransferQueue's process ends with its parent, and the launcher, which gets the same Ctrl-C,
    stops the other ranks and says how to resume."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _thread_lock_for_progress_bars() -> None:
    """tqdm's default lock holds a multiprocessing RLock: under the spawn start method a named
    semaphore, which a rank that dies of a signal leaves to Python's resource tracker, and the
    tracker then warns of "leaked semaphore objects". A rank's bars (its own, transformers')
    are drawn by threads of this one process: a thread lock serves them."""
    try:
        from tqdm import tqdm  # optional: a progress bar only where installed
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _stop_this_rank(why: str) -> None:
    """The TransferQueue service's process died under the run (the watcher logged why): stop this
    rank as the launcher would (SIGTERM), so the run ends now instead of at its next timeout."""
    os.write(2, f"asyncflow: {why}; stopping rank {os.environ.get('RANK', '0')}\n".encode("utf-8", "replace"))
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_report(driver: Driver) -> Iterator[None]:
    """While in this block, a SIGTERM first writes to stderr which calls ``driver`` was waiting
    for (rank, role, method, how long), then takes its course as before (this process dies of it).

    When one rank exits, torch stops every other one with SIGTERM (SIGKILL 30 s later): under
    torchrun its elastic agent, under launch_local torch.multiprocessing's spawn context. That
    is usually seconds before the driver's heartbeats notice: without this, rank 0 dies without
    a word and only the dead rank's number is ever printed. A plain ``signal.signal`` handler
    rather than the event loop's: it also runs while ``main`` blocks the loop. It writes with
    ``os.write``, not ``print``: the handler may interrupt a ``print`` on this thread, and a
    buffered stream is not reentrant. Main thread only; a SIGTERM that is ignored here stays
    ignored."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        try:
            what = driver.describe_in_flight()
        except Exception as e:  # noqa: BLE001 - the report must not stop the exit
            what = f"(unknown: {type(e).__name__}: {e})"
        line = (f"asyncflow: stopped by the launcher (SIGTERM; another rank probably died) "
                f"while waiting for: {what}\n")
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass
        # The previous disposition (the default: die of SIGTERM, a non-zero exit), re-raised.
        signal.signal(signum, previous)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def run_driver(cfg: LaunchConfig, addresses: list[str], host: str, tq: Any = None,
                     nodes: list[int] | None = None, *, report_sigterm: bool = False, store: Any = None) -> int:
    """Start the TransferQueue (unless ``tq``, a started service, is given), check every node's
    storage unit is registered (``nodes``: each rank's node), attach to the workers, run
    ``main``; 0 on success, else 1. ``report_sigterm``: this process is a launched rank 0,
    whose launcher stops it with SIGTERM when another rank dies (:func:`sigterm_report`)."""
    if tq is None and cfg.transfer_queue:
        tq = TransferQueueService(TransferQueueConfig(host=host)).start_in_thread()
    driver = Driver(addresses, placement=cfg.placement, config=cfg.driver,
                    transfer_queue_address=tq.controller_address if tq else None)
    driver.store = store  # where a supervising launcher takes restart requests (supervise.py)
    report = sigterm_report(driver) if report_sigterm else contextlib.nullcontext()
    with report:
        try:
            main = import_function(cfg.main)
            if tq is not None and nodes and cfg.tq_units.per_node:
                await wait_for_node_units(tq.controller_address, nodes, cfg.tq_units.register_timeout_s)
            await driver.start()
            await driver.run(main(driver, *cfg.main_args))
            return 0
        except Exception as e:  # noqa: BLE001 - the run's failure: print it whole, exit non-zero
            print(f"asyncflow driver failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            _leave_failure(e)
            return 1
        finally:
            if tq is not None:  # while every node's unit still runs
                await write_unit_stats(tq.controller_address, cfg.tq_units.stats_path)
            await driver.shutdown()
            if tq is not None:
                tq.stop_in_thread()


FAILURE_FILE_ENV = "ASYNCFLOW_FAILURE_FILE"


def _leave_failure(e: BaseException) -> None:
    """The driver's error, for the launcher to repeat as its last line: torch's own report of
    the exiting ranks otherwise buries it under its tracebacks."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        lines = f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__]
        more = " (the whole error, with the remote traceback, is above)" if len(lines) > 1 else ""
        try:
            Path(path).write_text(lines[0][:2000] + more)
        except OSError:
            pass  # the full traceback is on stderr already


def run_from_env(cfg: LaunchConfig) -> int:
    """The rank entry under torchrun (or elastic_launch): reads RANK, WORLD_SIZE, ... ."""
    env = os.environ
    try:
        return run_rank(cfg, int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        env["MASTER_ADDR"], int(env["MASTER_PORT"]), node=node_from_env())
    except KeyError as e:
        raise LaunchError(f"environment variable {e} is not set: start under torchrun, or use --nproc") from None


def _elastic_entry(cfg: LaunchConfig) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    code = run_from_env(cfg)
    if code:
        raise SystemExit(code)
    return code


def launch_local(cfg: LaunchConfig, nproc: int, *, monitor_interval_s: float = 0.2,
                 describe_rank: Callable[[int], str] | None = None) -> int:
    """Start ``nproc`` local ranks through torch's elastic launcher; returns the exit code.

    The launcher stops every rank as soon as one dies, often before the driver can say
    which role was lost: ``describe_rank(rank)`` (e.g. its roles) goes into that message."""

    lc = ElasticLaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"asyncflow-{uuid.uuid4().hex[:8]}",
                      rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                      monitor_interval=monitor_interval_s, start_method="spawn")
    # By its importable name, not __main__'s: spawned children unpickle it from there.
    from asyncflow.single_controller.launch import _elastic_entry as entry
    failure = Path(tempfile.mkdtemp(prefix="asyncflow-launch-")) / "driver_failure.txt"
    previous = os.environ.get(FAILURE_FILE_ENV)
    os.environ[FAILURE_FILE_ENV] = str(failure)  # the ranks inherit it
    try:
        elastic_launch(lc, entry)(cfg)
        return 0
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the global rank
        how = f"was killed by {first.signal_name()}" if first.exitcode < 0 else f"exited with code {first.exitcode}"
        who = describe_rank(rank) if describe_rank is not None else ""
        cause = f"\nasyncflow run failed: the driver's error: {failure.read_text()}" if failure.is_file() else ""
        print(f"asyncflow run failed: rank {rank}{f' ({who})' if who else ''} {how} (pid {first.pid})\n"
              f"{e.format_msg()}{cause}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # Ctrl-C or a kill of this launcher: torch has stopped every rank
        name = signal.Signals(e.sigval).name
        print(f"asyncflow run interrupted: this launcher got {name} and stopped its {nproc} ranks",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)  # the shell's code for a death by that signal
    finally:
        shutil.rmtree(failure.parent, ignore_errors=True)
        if previous is None:
            os.environ.pop(FAILURE_FILE_ENV, None)
        else:
            os.environ[FAILURE_FILE_ENV] = previous


def _parse_ranks(items: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for it in items:
        role, sep, val = it.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {it!r}: expected ROLE=VALUE")
        out[role] = val
    return out


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, int | None]:
    p = argparse.ArgumentParser(description="Run an AsyncFlow driver with one worker per rank.")
    p.add_argument("--main", required=True, help="package.module:function, an async function taking the Driver")
    p.add_argument("--nproc", type=int, default=None, help="self-launch this many local ranks (not under torchrun)")
    p.add_argument("--platform", default="auto", help="auto | cpu | cuda | npu")
    p.add_argument("--placement", default="colocated", choices=["colocated", "disaggregated"])
    p.add_argument("--role", action="append", default=[], help="ROLE=0,1,... ranks of a role (repeatable)")
    p.add_argument("--dp", action="append", default=[], help="ROLE=N data shards of a role (repeatable)")
    p.add_argument("--call-timeout", type=float, default=DriverConfig.call_timeout_s)
    p.add_argument("--no-transfer-queue", action="store_true")
    a = p.parse_args(argv)
    roles = {r: [int(x) for x in v.split(",") if x] for r, v in _parse_ranks(a.role, "--role").items()}
    dp = {r: int(v) for r, v in _parse_ranks(a.dp, "--dp").items()}
    cfg = LaunchConfig(main=a.main, platform=a.platform, placement=RolePlacement(a.placement, roles, dp),
                    driver=DriverConfig(call_timeout_s=a.call_timeout), transfer_queue=not a.no_transfer_queue)
    return cfg, a.nproc


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cfg, nproc = parse_args(argv)
    import_function(cfg.main)  # a typo in --main fails here, before any process starts
    if "RANK" in os.environ:
        sys.exit(run_from_env(cfg))
    if nproc is None:
        raise SystemExit("not under torchrun (no RANK): pass --nproc N to start N local ranks")
    sys.exit(launch_local(cfg, nproc))


if __name__ == "__main__":
    main()
