"""WorkerGroup: the driver's handle on one role; its registered methods are coroutines.

``await wg.generate(meta)`` splits the arguments with the method's dispatch mode, sends
one call per rank, and gathers the replies. Several groups can be kept busy at once
with ``asyncio.gather``. ``_timeout=`` overrides a call's timeout.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
from typing import TYPE_CHECKING, Any

from .dispatch import MethodSpec, get_dispatch_mode, method_spec
from .layout import GroupLayout
from .wire import to_wire

if TYPE_CHECKING:
    from .driver import Driver


class WorkerGroup:
    def __init__(self, driver: "Driver", layout: GroupLayout, cls: type):
        self.driver = driver
        self.layout = layout
        self.cls = cls
        self.methods: dict[str, MethodSpec] = {}
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
        what = f"{self.layout.role}.{method}"
        # All rank calls are started back to back with no await in between, so every rank
        # queues this call at the same place relative to other calls: collectives inside
        # methods of different groups sharing ranks then run in the same order everywhere.
        payloads = [None if c is None else (to_wire(list(c[0])), to_wire(c[1])) for c in per_rank]
        if sum(p is not None for p in payloads) == 1:  # one rank: no fan-out task needed
            i = next(i for i, p in enumerate(payloads) if p is not None)
            result = await self.driver.ranks[self.layout.ranks[i]].request(
                "call", what, self.layout.role, timeout, role=self.layout.role, fn=method,
                args=payloads[i][0], kwargs=payloads[i][1])
            return mode.gather(self.layout, [result if j == i else None for j in range(len(payloads))])
        tasks: list[asyncio.Future | None] = [
            None if p is None else asyncio.ensure_future(self.driver.ranks[rank].request(
                "call", what, self.layout.role, timeout, role=self.layout.role, fn=method,
                args=p[0], kwargs=p[1]))
            for rank, p in zip(self.layout.ranks, payloads)]
        live = [t for t in tasks if t is not None]
        try:
            done, pending = await asyncio.wait(live, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in live:
                t.cancel()
            raise
        if any(t.exception() is not None for t in done):
            # Other ranks often fail the same way a moment later: wait briefly, then report
            # the lowest failing rank, so the error does not depend on which reply came first.
            if pending:
                await asyncio.wait(pending, timeout=0.5)
            for t in live:
                if not t.done():
                    t.cancel()
            failed = [t for t in live if t.done() and not t.cancelled() and t.exception() is not None]
            first = failed[0].exception()
            if len(failed) > 1 and hasattr(first, "add_note"):  # 3.11+
                first.add_note(f"({len(failed) - 1} more rank(s) of {what} failed as well)")
            raise first
        return mode.gather(self.layout, [t.result() if t is not None else None for t in tasks])

    def __repr__(self) -> str:
        return f"WorkerGroup({self.cls.__name__}, role={self.layout.role!r}, ranks={self.ranks})"
