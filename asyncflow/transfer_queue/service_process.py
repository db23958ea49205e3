"""The TransferQueue service (controller and node 0's storage unit) as a process of its own.

A launched job's driver rank starts it (``transfer_queue.service: own_process``, the
default) so that the controller's and the unit's request handling never holds the GIL of a
process that also trains or generates. The child is tied to its parent through its stdin:
it serves until that pipe closes, which happens when the parent stops it and also when the
parent dies, so no service outlives its run. Its first line of stdout is its controller
address; after that its stdout goes where its stderr goes (the parent's stderr, the run's log).

The run key travels in the environment (``ASYNCFLOW_RUN_KEY``, exported by the rank that
installed it), never on the command line. Samplers are looked up in the controller's
process: the child imports the run's ``imports`` (``--import``) before serving, so samplers
registered there are known. A module of its own so that ``python -m`` does not find it
already imported by the package.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import select
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ..rpc import auth
from .errors import TransferQueueError
from .service import TransferQueueConfig, TransferQueueService
from .unit_process import prepare_unit_process

log = logging.getLogger(__name__)

MODULE = "asyncflow.transfer_queue.service_process"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child_env() -> dict[str, str]:
    """The parent's environment (with the run key); a checkout that is not installed is put on
    PYTHONPATH so the child imports the same asyncflow. An installed one is left alone: putting
    site-packages ahead of the standard library would change what the child imports."""
    env = dict(os.environ)
    sites = {os.path.abspath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if _PACKAGE_ROOT not in sites:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = " (the kernel's out-of-memory killer sends this)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class ServiceProcess:
    """Parent side: start the child, read its controller address, watch it, stop it.

    Offers what the launcher uses of an in-process ``TransferQueueService``
    (``controller_address``, ``stop_in_thread``), so the caller need not know where it runs.
    ``on_death(message)`` runs (on a watcher thread) if the child ends before it was asked to.
    """

    def __init__(self, config: TransferQueueConfig, start_timeout_s: float = 60.0,
                 imports: Sequence[str] = (), on_death: Callable[[str], None] | None = None):
        cmd = [sys.executable, "-m", MODULE, "--host", config.host, "--units", str(config.num_local_units),
               "--wait-timeout", str(config.wait_timeout_s)]
        if config.max_rows_per_unit is not None:
            cmd += ["--max-rows", str(config.max_rows_per_unit)]
        if config.max_bytes_per_unit is not None:
            cmd += ["--max-bytes", str(config.max_bytes_per_unit)]
        for module in imports:
            cmd += ["--import", module]
        self._stopping = threading.Event()
        self._on_death = on_death
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env())
        try:
            self.controller_address = self._read_address(start_timeout_s)
        except BaseException:
            self.stop_in_thread()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tq-service-watch", daemon=True)
        self._watcher.start()
        log.info("TransferQueue service process %d serving at %s", self._proc.pid, self.controller_address)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read_address(self, timeout_s: float) -> str:
        stdout = self._proc.stdout
        if stdout is None:  # started with stdout=PIPE (__init__): never None here
            raise RuntimeError("TransferQueue service process has no stdout pipe")
        fd = stdout.fileno()
        pending = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            chunk = os.read(fd, 4096) if ready else None
            if chunk == b"" or (chunk is None and self._proc.poll() is not None):
                try:
                    code = self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) closed its "
                                             "stdout without reporting an address") from None
                raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) "
                                         f"{_describe_exit(code)} before serving; its error is in this run's "
                                         "log above")
            pending += chunk or b""
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace").strip()
                if text.startswith("tcp://"):
                    return text
                if text:  # something else printed first (a library): not ours to parse
                    log.warning("TransferQueue service process %d printed %r before its address",
                                self._proc.pid, text[:200])
        raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) did not report its "
                                 f"address within {timeout_s:.0f}s (`python -m {MODULE}` started but is not "
                                 "serving; a machine this loaded may need transfer_queue.register_timeout_s higher)")

    def _watch(self) -> None:
        code = self._proc.wait()
        if self._stopping.is_set():
            return
        message = (f"the TransferQueue service process (pid {self._proc.pid}) {_describe_exit(code)} while the "
                   "run was using it: every row it held is lost")
        log.error(message)
        if self._on_death is not None:
            self._on_death(message)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop_in_thread(self, timeout_s: float = 10.0) -> None:
        """Close the child's stdin (its signal to stop) and wait for it; kill it past ``timeout_s``.
        Idempotent."""
        self._stopping.set()
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the TransferQueue service process %d did not stop within %.0fs of being asked: killed",
                        proc.pid, timeout_s)
            proc.kill()
            proc.wait(timeout_s)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
        if proc.returncode not in (0, None):
            log.warning("the TransferQueue service process %d %s", proc.pid, _describe_exit(proc.returncode))


async def _serve(config: TransferQueueConfig) -> None:
    service = await TransferQueueService(config).start()
    sys.stdout.write(service.controller_address + "\n")
    sys.stdout.flush()
    os.dup2(2, 1)  # nobody reads our stdout after the address: a later print must not fill the pipe
    # Until the parent closes our stdin (to stop us, or by dying): read() returns at EOF.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run the TransferQueue controller and its local storage units "
                                            "until stdin closes (started by a launched job's driver rank).")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--units", type=int, default=1, help="storage units inside this process")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--wait-timeout", type=float, default=300.0)
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="a module to import first (where the run registers its samplers); repeatable")
    a = p.parse_args(argv)
    if auth.key_source() == "generated":  # nothing inherited: the key made at import is ours alone
        raise SystemExit(f"no run key: set {auth.ENV_VAR} (hex) in the environment, as a rank that starts this "
                         "process does; a service with a key of its own would drop every message of the run")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tq-service %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the parent stops us (stdin) once its driver has
    # read what it needs (the final unit stats), not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in a.imports:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise SystemExit(f"the TransferQueue service cannot import {module!r} (the run's imports): {e}") from None
    prepare_unit_process()
    asyncio.run(_serve(TransferQueueConfig(host=a.host, num_local_units=a.units, max_rows_per_unit=a.max_rows,
                                           max_bytes_per_unit=a.max_bytes, wait_timeout_s=a.wait_timeout)))


if __name__ == "__main__":
    main()
