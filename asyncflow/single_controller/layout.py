"""Where a worker group lives: its ranks, and how they split into data-parallel shards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupLayout:
    """A worker group of ``ranks`` (global ranks, in group order) with ``dp_size`` data shards.

    Shard ``i`` is the consecutive ranks ``ranks[i*m:(i+1)*m]`` with ``m = len(ranks) // dp_size``
    (the model-parallel peers that see the same data); its first rank is the shard leader,
    the one that talks to the TransferQueue. ``dp_peers(j)`` are the ranks at position ``j``
    of every shard: the group that all-reduces gradients.
    """

    role: str
    ranks: tuple[int, ...]
    dp_size: int

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"role {self.role!r}: a worker group needs at least one rank")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"role {self.role!r}: ranks repeat in {list(self.ranks)}")
        if self.dp_size < 1 or len(self.ranks) % self.dp_size:
            raise ValueError(f"role {self.role!r}: dp_size {self.dp_size} does not divide "
                             f"{len(self.ranks)} ranks")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def shard_size(self) -> int:
        return len(self.ranks) // self.dp_size

    def shard_of(self, index: int) -> int:
        return index // self.shard_size

    def is_leader(self, index: int) -> bool:
        return index % self.shard_size == 0

    def shard_ranks(self, shard: int) -> list[int]:
        m = self.shard_size
        return list(self.ranks[shard * m:(shard + 1) * m])

    def dp_peers(self, position: int) -> list[int]:
        return [self.ranks[s * self.shard_size + position] for s in range(self.dp_size)]

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "ranks": list(self.ranks), "dp_size": self.dp_size}

    @staticmethod
    def from_wire(w: dict[str, Any]) -> GroupLayout:
        return GroupLayout(w["role"], tuple(int(r) for r in w["ranks"]), int(w["dp_size"]))
