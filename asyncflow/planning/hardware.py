"""Accelerator presets: memory, peak dense bf16/fp16 FLOP/s and memory bandwidth.

Figures are vendors' or publicly reported peaks, not measured by AsyncFlow; every one can be
overridden on the command line, and the plan prints the ones it used.
- h100: NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16.
- a100: NVIDIA A100 SXM4 80GB datasheet: 2.039 TB/s, 312 TFLOP/s dense BF16.
- 910b: Ascend 910B as publicly reported: 64 GB HBM2e, ~320 TFLOP/s FP16; the 1.6 TB/s
  bandwidth is an assumption (four HBM2e stacks), not a Huawei figure we could confirm.
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncflow.planning.params import PlanInputError

__all__ = ["GIB", "PRESETS", "Hardware"]

GIB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    """The devices of a run: how many, and what one of them holds and does."""
    count: int
    memory_gib: float  # GiB (2^30 bytes): an "80 GB" H100 holds 80 GiB
    peak_tflops: float  # dense bf16/fp16
    bandwidth_tbs: float  # device memory, TB/s (10^12 bytes/s)
    reserved_gib: float = 4.0  # runtime context, collective buffers, allocator fragmentation
    name: str = "custom"
    devices_per_node: int = 8  # a rollout instance's tensor parallelism stays within one node


    def __post_init__(self) -> None:
        if self.count < 1 or self.devices_per_node < 1:
            raise PlanInputError(f"devices and devices per node: need at least 1, got {self.count} and "
                                 f"{self.devices_per_node}")
        if min(self.memory_gib, self.peak_tflops, self.bandwidth_tbs) <= 0:
            raise PlanInputError(f"device memory, peak TFLOP/s and bandwidth must be > 0, got {self.memory_gib}, "
                                 f"{self.peak_tflops}, {self.bandwidth_tbs}")
        if not 0 <= self.reserved_gib < self.memory_gib:
            raise PlanInputError(f"reserved memory {self.reserved_gib} GiB must lie within 0..device memory "
                                 f"({self.memory_gib} GiB)")

    @property
    def usable_bytes(self) -> int:
        return round((self.memory_gib - self.reserved_gib) * GIB)


# name -> (memory GiB, peak TFLOP/s, bandwidth TB/s); sources in the module docstring
PRESETS: dict[str, tuple[float, float, float]] = {
    "h100": (80.0, 989.0, 3.35),
    "a100": (80.0, 312.0, 2.039),
    "910b": (64.0, 320.0, 1.6),
}
