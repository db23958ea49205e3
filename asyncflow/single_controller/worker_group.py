"""WorkerGroup: the driver's handle on one role; its registered methods are coroutines.

``await wg.generate(meta)`` splits the arguments with the method's dispatch mode, sends
one call per rank, and gathers the replies. Several groups can be kept busy at once
with ``asyncio.gather``. ``_timeout=`` overrides a call's timeout.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from typing import Any, Protocol

from ..rpc.async_client import RpcClient
from ..rpc.spin import SpinPolicy
from .dispatch import MethodSpec, get_dispatch_mode, method_spec
from .layout import GroupLayout
from .ranks import RankCall, RankEndpoint, spin_calls, wait_calls
from .wire import to_wire
from .worker import Worker


class GroupDriver(Protocol):
    """What a group uses of the driver that made it: ``driver.Driver`` is one. (The driver
    imports this module, not the other way round.)"""

    ranks: list[RankEndpoint]
    config: Any  # driver.DriverConfig: call_timeout_s, spin_us

    def check(self) -> None: ...


class WorkerGroup:
    def __init__(self, driver: GroupDriver, layout: GroupLayout, cls: type[Worker]):
        self.driver = driver
        self.layout = layout
        self.cls = cls
        self.methods: dict[str, MethodSpec] = {}
        self._spin: dict[str, SpinPolicy] = {}  # per method: its calls are short or long
        # No spinning for a group with a rank served on a thread of this process: the spinner
        # and that thread then pass the GIL back and forth, each pass a wake-up, which makes
        # that rank's calls slower, not faster.
        shares_gil = any(driver.ranks[r].in_process for r in layout.ranks)
        self._spin_s = 0.0 if shares_gil else driver.config.spin_us * 1e-6
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            spec = method_spec(fn)
            if spec is not None:
                self.methods[name] = spec
                setattr(self, name, functools.partial(self.call, name))

    @property
    def role(self) -> str:
        return self.layout.role

    @property
    def ranks(self) -> list[int]:
        return list(self.layout.ranks)

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not set
        raise AttributeError(f"{self.cls.__name__} (role {self.layout.role!r}) has no method {name!r} marked "
                             f"with @register; registered: {sorted(self.__dict__.get('methods', {}))}")

    async def call(self, method: str, *args: Any, _timeout: float | None = None, **kwargs: Any) -> Any:
        self.driver.check()
        spec = self.methods[method]
        mode = get_dispatch_mode(spec.mode)
        timeout = _timeout or spec.timeout_s or self.driver.config.call_timeout_s
        per_rank = mode.split(self.layout, args, kwargs)
        started = time.perf_counter()
        role = self.layout.role
        what = f"{role}.{method}"
        # All rank calls are sent back to back with no await in between, so every rank
        # queues this call at the same place relative to other calls: collectives inside
        # methods of different groups sharing ranks then run in the same order everywhere.
        # The same arguments (ONE_TO_ALL gives every rank the same pair) are encoded once.
        encoded: dict[int, list[Any]] = {}
        ranks = self.driver.ranks
        calls: list[RankCall | None] = []
        for rank, rank_args in zip(self.layout.ranks, per_rank):
            if rank_args is None:
                calls.append(None)
                continue
            frames = encoded.get(id(rank_args))
            if frames is None:
                frames = encoded[id(rank_args)] = RpcClient.encode_args(
                    {"role": role, "fn": method, "args": to_wire(list(rank_args[0])), "kwargs": to_wire(rank_args[1])})
            if spec.concurrent:  # to the control server: served beside a running call
                calls.append(ranks[rank].start("call_concurrent", what, role, timeout, frames, control=True))
            else:
                calls.append(ranks[rank].start("call", what, role, timeout, frames))
        live = [c for c in calls if c is not None]
        policy = self._spin.get(method)
        if policy is None:
            policy = self._spin[method] = SpinPolicy(self._spin_s)
        budget = 0.0 if spec.concurrent else policy.budget()
        spun = spin_calls(live, budget) if budget else None
        if len(live) == 1:  # one rank: its future is all there is to wait for
            try:
                value = await live[0].wait()
            finally:
                policy.observe(time.perf_counter() - started, spun)
            return mode.gather(self.layout, [value if c is not None else None for c in calls])
        try:
            await wait_calls(live)
        finally:
            policy.observe(time.perf_counter() - started, spun)
        if any(c.fut.done() and c.failed() for c in live):
            # Other ranks often fail the same way a moment later: wait briefly, then report
            # the lowest failing rank, so the error does not depend on which reply came first.
            pending = [c.fut for c in live if not c.fut.done()]
            if pending:
                await asyncio.wait(pending, timeout=0.5)
            for c in live:
                if not c.fut.done():
                    c.cancel()
            errors = []
            for c in live:
                if not c.fut.cancelled() and c.failed():
                    try:
                        c.result()
                    except Exception as e:  # noqa: BLE001 - collected, the first one raised
                        errors.append(e)
            first = errors[0]
            if len(errors) > 1 and hasattr(first, "add_note"):  # 3.11+
                first.add_note(f"({len(errors) - 1} more rank(s) of {what} failed as well)")
            raise first
        return mode.gather(self.layout, [c.result() if c is not None else None for c in calls])

    def __repr__(self) -> str:
        return f"WorkerGroup({self.cls.__name__}, role={self.layout.role!r}, ranks={self.ranks})"
