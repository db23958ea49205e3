"""Placement: which ranks run which role. The driver code is the same for both modes.

- ``colocated``: every role runs on every rank (or on ``ranks`` when given); roles take
  turns on a rank (offload/onload between them), as verl's hybrid engine.
- ``disaggregated``: each role runs on its own named ranks, so roles run at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("colocated", "disaggregated")


@dataclass
class RolePlacement:
    mode: str = "colocated"
    roles: dict[str, list[int]] = field(default_factory=dict)  # role -> ranks (required when disaggregated)
    dp_size: dict[str, int] = field(default_factory=dict)  # role -> data shards (default: one per rank)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"placement.mode: expected one of {MODES}, got {self.mode!r}")

    def ranks_for(self, role: str, world_size: int) -> list[int]:
        if role in self.roles:
            ranks = [int(r) for r in self.roles[role]]
        elif self.mode == "colocated":
            ranks = list(range(world_size))
        else:
            raise ValueError(f"placement.roles: disaggregated placement names no ranks for role {role!r} "
                             f"(roles given: {sorted(self.roles)})")
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad or not ranks:
            raise ValueError(f"placement.roles.{role}: ranks {ranks} must be a non-empty list within "
                             f"0..{world_size - 1}")
        return ranks

    def dp_size_for(self, role: str, n_ranks: int) -> int:
        return int(self.dp_size.get(role, n_ranks))
