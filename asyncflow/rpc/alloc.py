"""Memory tuning for processes that mostly move messages: keep freed message memory in a
storage process instead of giving it back to the OS, and keep the import-time heap out of
Python's garbage collector.

A storage unit holds every received ZMQ frame until its rows are cleared, then frees a
whole partition at once. glibc then returns that memory to the OS (it trims a heap whose
free top exceeds its trim threshold, and unmaps chunks above its mmap threshold), so the
next messages libzmq's I/O thread receives fault in fresh pages, one kernel fault per 4 KiB,
far more faults than a store that frees each payload at once, paid in the storage process's
system time. Raising both thresholds keeps up to ``trim_bytes`` of freed memory per heap for
the next messages.

Process-wide (``mallopt``), so it is for a process that mostly stores: a storage unit's
own process (``unit_process``) and the TransferQueue service's (``service_process``) do it
by default; a service in the driver's rank only when ``TransferQueueConfig.keep_freed_memory``
says so (that rank also trains, and every allocator arena of it would keep that much).
glibc only; elsewhere a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's bound on 64-bit (half its 64 MiB heap): larger sizes are refused
DEFAULT_TRIM_BYTES = 256 << 20
ENV_VAR = "ASYNCFLOW_TQ_KEEP_FREED_MB"  # overrides trim_bytes; 0 turns the tuning off
_frozen_here = False  # this process froze its heap at start (freeze_gc_heap): it is one of ours


def keep_freed_memory(trim_bytes: int = DEFAULT_TRIM_BYTES) -> bool:
    """Let this process's allocator keep up to ``trim_bytes`` of freed memory per heap, and serve
    blocks up to 32 MiB from its heaps (reused) rather than fresh mappings. True when applied."""
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        try:
            trim_bytes = int(float(env) * (1 << 20))
        except ValueError:
            raise ValueError(f"{ENV_VAR}={env!r}: expected a number of MiB (0 turns the tuning off)") from None
    if trim_bytes <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # Setting either threshold also stops glibc from moving them itself (its dynamic mmap
        # threshold), so both are set.
        ok: bool = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(trim_bytes, 2**31 - 1))) == 1 and ok
    except (OSError, AttributeError) as e:  # not glibc after all
        log.debug("mallopt unavailable: %s", e)
        return False
    return ok


def freeze_gc_heap() -> int:
    """Move every object alive now (modules, classes, torch's operator tables: hundreds of
    thousands after ``import torch``) out of the cyclic collector's reach. A full collection
    walks every tracked object, and a storage process, which makes many short-lived objects
    per batch, runs one every few batches: without the freeze each walks that whole heap again
    (perf/bench_transfer_queue.py shows it in the storage process's CPU per batch). Call it after
    the imports and before the serving loop (``refreeze_gc_heap`` calls it again once more is
    built): objects frozen are never collected, so
    garbage made before the call and freed only by the collector stays (a one-off). Returns
    the objects now frozen."""
    global _frozen_here
    gc.collect()
    gc.freeze()
    _frozen_here = True
    return gc.get_freeze_count()


def refreeze_gc_heap() -> int:
    """Freeze again what a process that froze its heap at start (``freeze_gc_heap``) has made
    since: a rank builds its models after its start (transformers' modules, the model's
    modules and parameters, the run's data), and without this every full collection of the RL
    loop walks them all again, on the step's critical path.
    A no-op in a process that never froze (a test's, a user's): freezing keeps garbage made
    before the call, which only a process of ours can afford. Returns the objects now frozen."""
    return freeze_gc_heap() if _frozen_here else 0
