"""Worker classes of the data-parallel tests (DP_COMPUTE's broadcast, the DP sub-group, the
collective timeout). A module of its own so that worker processes (spawned) import them by
name, as _sc_workers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from asyncflow.single_controller import Dispatch, Worker, register


class DpWorker(Worker):
    def __init__(self) -> None:
        self.taken: list[dict] = []  # what each DP_COMPUTE call handed this rank

    @register(Dispatch.DP_COMPUTE)
    def take(self, data) -> dict:
        self.taken.append({k: data[k].tolist() for k in sorted(data.keys())})
        x = data["x"]
        return {"y": x * 10, "y_rank": torch.full_like(x, self.rank)}

    @register(Dispatch.ONE_TO_ALL)
    def seen(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.dp_rank, "leader": self.is_shard_leader, "taken": self.taken}

    @register(Dispatch.ONE_TO_ALL)
    def members(self) -> dict:
        """The global ranks that took part in an all_reduce over each of this rank's process
        groups (None: no group): each rank adds ``1 << rank``, so the sum names its members."""
        def total(group):
            if group is None:
                return None
            t = torch.tensor([1 << self.rank], dtype=torch.int64)
            dist.all_reduce(t, group=group)
            return [r for r in range(self.world_size) if int(t[0]) >> r & 1]
        # The same order on every rank: each all_reduce is collective over its group.
        return {"rank": self.rank, "dp": total(self.dp_group), "shard": total(self.shard_group),
                "whole": total(self.process_group)}

    @register(Dispatch.RANK_ZERO)
    def lonely_reduce(self) -> float:
        """A collective over the whole group, run on the group's first rank only: it can only
        end by the process group's timeout."""
        t = torch.ones(1)
        dist.all_reduce(t, group=self.process_group)
        return float(t[0])

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> int:
        return self.rank
