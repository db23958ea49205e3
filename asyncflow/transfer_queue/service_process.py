"""The TransferQueue service (controller and node 0's storage unit) as a process of its own.

A launched job's driver rank starts it (``transfer_queue.service: own_process``, the
default) so that the controller's and the unit's request handling never holds the GIL of a
process that also trains or generates. The child is tied to its parent through its stdin:
it serves until that pipe closes, which happens when the parent stops it and also when the
parent dies, so no service outlives its run. It prints its controller address as its first
line of stdout; its log and errors go to the parent's stderr.

The run key travels in the environment (``ASYNCFLOW_RUN_KEY``, exported by the rank that
installed it), never on the command line. A module of its own so that ``python -m`` does
not find it already imported by the package.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import signal
import subprocess
import sys
import time

from ..rpc import auth
from .errors import TransferQueueError
from .service import TransferQueueConfig, TransferQueueService

log = logging.getLogger(__name__)

MODULE = "asyncflow.transfer_queue.service_process"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServiceProcess:
    """Parent side: start the child, read its controller address, stop it.

    Offers what the launcher uses of an in-process ``TransferQueueService``
    (``controller_address``, ``stop_in_thread``), so the caller need not know where it runs.
    """

    def __init__(self, config: TransferQueueConfig, start_timeout_s: float = 60.0):
        cmd = [sys.executable, "-m", MODULE, "--host", config.host, "--units", str(config.num_local_units),
               "--wait-timeout", str(config.wait_timeout_s)]
        if config.max_rows_per_unit is not None:
            cmd += ["--max-rows", str(config.max_rows_per_unit)]
        if config.max_bytes_per_unit is not None:
            cmd += ["--max-bytes", str(config.max_bytes_per_unit)]
        # The child inherits the run key with the environment (auth exports it when installed),
        # and imports this same asyncflow whatever its working directory.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            self.controller_address = self._read_address(start_timeout_s)
        except BaseException:
            self.stop_in_thread()
            raise
        log.info("TransferQueue service process %d serving at %s", self._proc.pid, self.controller_address)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read_address(self, timeout_s: float) -> str:
        out = self._proc.stdout
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline().decode().strip()
                if line.startswith("tcp://"):
                    return line
                code = self._proc.wait(10)
                raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) exited with "
                                         f"code {code} before serving; its error is in this run's log above")
            if self._proc.poll() is not None:
                raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) exited with "
                                         f"code {self._proc.returncode} before serving; its error is in this "
                                         "run's log above")
        raise TransferQueueError(f"the TransferQueue service process (pid {self._proc.pid}) did not report its "
                                 f"address within {timeout_s:.0f}s (`python -m {MODULE}` started but is not "
                                 "serving; a machine this loaded may need transfer_queue.register_timeout_s higher)")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop_in_thread(self, timeout_s: float = 10.0) -> None:
        """Close the child's stdin (its signal to stop) and wait for it; kill it past ``timeout_s``.
        Idempotent."""
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
            log.warning("the TransferQueue service process %d exited with code %s", proc.pid, proc.returncode)


async def _serve(config: TransferQueueConfig) -> None:
    service = await TransferQueueService(config).start()
    sys.stdout.write(service.controller_address + "\n")
    sys.stdout.flush()
    # Until the parent closes our stdin (to stop us, or by dying): read() returns at EOF.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    from .unit_process import prepare_unit_process

    p = argparse.ArgumentParser(description="Run the TransferQueue controller and its local storage units "
                                            "until stdin closes (started by a launched job's driver rank).")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--units", type=int, default=1, help="storage units inside this process")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--wait-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    if auth.key_source() == "generated":  # nothing inherited: the key made at import is ours alone
        raise SystemExit(f"no run key: set {auth.ENV_VAR} (hex) in the environment, as a rank that starts this "
                         "process does; a service with a key of its own would drop every message of the run")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tq-service %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the parent stops us (stdin) once its driver has
    # read what it needs (the final unit stats), not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepare_unit_process()
    asyncio.run(_serve(TransferQueueConfig(host=a.host, num_local_units=a.units, max_rows_per_unit=a.max_rows,
                                           max_bytes_per_unit=a.max_bytes, wait_timeout_s=a.wait_timeout)))


if __name__ == "__main__":
    main()
