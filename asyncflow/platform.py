"""Device platforms: cpu (gloo), cuda (nccl) and npu (hccl, through torch_npu).

Everything that depends on the kind of device goes through a `Platform`, so the
rest of AsyncFlow runs the same code on a laptop CPU, NVIDIA GPUs and Ascend NPUs.
This module imports nothing from the rest of asyncflow.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = ["BACKENDS", "Platform", "get_platform", "resolve_dtype", "threads_per_rank", "usable_cpus"]

# torch.distributed backend of each platform.
BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@functools.cache
def _import_torch_npu() -> tuple[ModuleType | None, str]:
    """Import torch_npu once; returns (module or None, why it failed).

    Lazy because torch_npu is heavy, exists only on Ascend machines, and on import
    registers `torch.npu` and the 'npu' device type. Not only ImportError: a
    missing CANN library surfaces as OSError or RuntimeError.
    """
    try:
        return importlib.import_module("torch_npu"), ""
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable torch_npu"
        return None, f"{type(exc).__name__}: {exc}"


def _host_rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # no /proc (macOS): best we have is the peak
        return _host_peak_rss_bytes()


def _host_peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes."""
    import resource  # POSIX only; imported here so the module still imports elsewhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak if os.uname().sysname == "Darwin" else peak * 1024


@dataclass(frozen=True)
class Platform:
    """One kind of device and the collective backend that goes with it."""

    name: str  # 'cpu' | 'cuda' | 'npu'; also the torch device type
    backend: str  # 'gloo' | 'nccl' | 'hccl'

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"

    def _module(self) -> ModuleType:
        """torch.cuda, or torch.npu (which exists once torch_npu is imported)."""
        if self.name == "npu":
            _import_torch_npu()
        return getattr(torch, self.name)

    def is_available(self) -> bool:
        if self.name == "cpu":
            return True
        if self.name == "npu" and _import_torch_npu()[0] is None:
            return False
        return bool(self._module().is_available())

    def device_count(self) -> int:
        """Devices visible to this process; the CPU counts as one."""
        if self.name == "cpu":
            return 1
        if not self.is_available():
            return 0
        return int(self._module().device_count())

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        """The device that the rank with this node-local index works on.

        Modulo the device count, for a rank that sees fewer devices than its node has ranks
        (started with a device of its own, e.g. by srun); `get_platform` refuses nccl/hccl
        ranks that would share one. Does not make it the current device: call `set_device`.
        """
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        if self.name == "cpu":
            return torch.device("cpu")
        count = self.device_count()
        if count == 0:
            raise RuntimeError(f"platform {self.name!r} has no visible device")
        return torch.device(self.name, local_rank % count)

    def set_device(self, device: torch.device | int) -> None:
        """Make `device` the current one; nccl/hccl build their communicators on it."""
        if self.is_accelerator:
            self._module().set_device(device)

    def synchronize(self) -> None:
        """Wait for all queued device work (kernels run asynchronously on accelerators)."""
        if self.is_accelerator:
            self._module().synchronize()

    def memory_stats(self) -> dict[str, int]:
        """Memory use in bytes, the same keys on every platform.

        Accelerators: `allocated_bytes`/`reserved_bytes`/`peak_bytes` are the caching
        allocator's numbers for the current device (peak = max allocated).
        CPU: torch keeps no allocator statistics, so those three report the process's
        resident memory (peak = peak RSS). `rss_bytes` is always the host RSS.
        """
        rss = _host_rss_bytes()
        if self.name == "cpu":
            return {
                "allocated_bytes": rss,
                "reserved_bytes": rss,
                # The kernel's peak counter can lag the current one by a few pages.
                "peak_bytes": max(rss, _host_peak_rss_bytes()),
                "rss_bytes": rss,
            }
        mod = self._module()
        return {
            "allocated_bytes": int(mod.memory_allocated()),
            "reserved_bytes": int(mod.memory_reserved()),
            "peak_bytes": int(mod.max_memory_allocated()),
            "rss_bytes": rss,
        }

    def manual_seed(self, seed: int) -> None:
        """Seed the random generators of this platform's devices (all of them)."""
        if self.name == "cpu":
            torch.manual_seed(seed)  # the CPU's device RNG is torch's default generator
        else:
            self._module().manual_seed_all(seed)

    def supports_bf16(self) -> bool:
        """Whether the device computes in bfloat16 natively (not by emulation)."""
        if self.name == "cpu":
            return True  # torch's CPU kernels implement bf16 (fast only with AVX512-BF16/AMX)
        if not self.is_available():
            return False
        if self.name == "cuda":
            # The default also counts emulation, which pre-Ampere GPUs do slowly.
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return bool(self._module().is_bf16_supported())


def _unavailable_reason(name: str) -> str | None:
    """Why platform `name` cannot be used here, with how to fix it; None if it can."""
    if name == "cpu":
        return None
    if name == "cuda":
        if torch.cuda.is_available():
            return None
        build = " (this torch is a CPU-only build)" if torch.version.cuda is None else ""
        return (
            f"platform 'cuda' requested but torch {torch.__version__}{build} sees no CUDA "
            "device: install a CUDA build of torch on a machine with an NVIDIA GPU "
            "(check CUDA_VISIBLE_DEVICES), or use platform 'cpu'"
        )
    module, error = _import_torch_npu()
    if module is None:
        return (
            f"platform 'npu' requested but torch_npu cannot be imported ({error}): install "
            f"the CANN toolkit and the torch_npu release matching torch {torch.__version__} "
            "(pip install -e '.[npu]'), or use platform 'cpu'"
        )
    if not torch.npu.is_available():  # type: ignore[attr-defined]  # torch_npu's import adds torch.npu
        return (
            "platform 'npu' requested but torch_npu sees no NPU device: check the Ascend "
            "driver (npu-smi info) and ASCEND_RT_VISIBLE_DEVICES, or use platform 'cpu'"
        )
    return None


def get_platform(name: str = "auto", ranks_per_node: int = 1) -> Platform:
    """The platform called `name`: 'cpu', 'cuda', 'npu', or 'auto', for `ranks_per_node`
    ranks on each node.

    nccl and hccl run one rank per device: two ranks on one device fail at their first
    collective. So 'auto' picks npu when torch_npu imports and sees a device for every rank
    of the node, else cuda likewise, else cpu (logging why an accelerator it saw was passed
    over). Asking for a platform this machine cannot use, or for fewer devices than ranks,
    raises RuntimeError saying why and what to do; an unknown name raises ValueError.
    """
    key = str(name).strip().lower()
    if key == "auto":
        for candidate in ("npu", "cuda"):
            if _unavailable_reason(candidate) is None:
                platform = Platform(candidate, BACKENDS[candidate])
                reason = _too_few_devices(platform, ranks_per_node)
                if reason is None:
                    return platform
                logging.getLogger(__name__).warning("platform auto: not %s: %s; running on the CPU", candidate, reason)
        return Platform("cpu", BACKENDS["cpu"])
    if key not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown platform {name!r}: expected one of {valid}")
    platform = Platform(key, BACKENDS[key])
    reason = _unavailable_reason(key) or _too_few_devices(platform, ranks_per_node)
    if reason is not None:
        raise RuntimeError(reason)
    return platform


def _too_few_devices(platform: Platform, ranks_per_node: int) -> str | None:
    """Why `ranks_per_node` ranks cannot each have a device of `platform` of their own; None if they can."""
    count = platform.device_count()
    if not platform.is_accelerator or ranks_per_node <= count:
        return None
    return (f"{ranks_per_node} ranks on this node but {count} {platform.name} device(s), and "
            f"{platform.backend} runs one rank per device: run as many ranks per node as devices "
            "(trainer.nproc; on one device: trainer.nproc=1 placement.mode=colocated), "
            "or use platform 'cpu'")


# ---- thread and dtype policy (what a rank takes of its node, by the kind of device) ----------


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (taskset, cgroup cpusets, Slurm's
    binding), not the host's count, which oversubscribes a process confined to a few cores."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity API (macOS, Windows)
        return os.cpu_count() or 1


def threads_per_rank(threads: int, ranks_overlap: bool, ranks_per_node: int, cpus: int | None = None) -> int:
    """torch threads per rank: ``threads`` when set (> 0); else, where the node's ranks compute
    at the same time (``ranks_overlap``), its cores shared out among them (``LOCAL_WORLD_SIZE``
    under torch's elastic agent, else ``ranks_per_node``); else 0 (torch's default: every
    core), for ranks that take turns. Oversubscribed cores cost more than a second thread gains
    at small sizes (perf/RESULTS.md)."""
    if threads > 0:
        return threads
    if not ranks_overlap:
        return 0
    cpus = cpus or usable_cpus()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or ranks_per_node
    return max(1, cpus // max(1, per_node))


def resolve_dtype(setting: str, accelerator: bool) -> str:
    """A dtype setting with ``auto`` resolved: bfloat16 on accelerators, float32 on CPU."""
    if setting != "auto":
        return setting
    return "bfloat16" if accelerator else "float32"
