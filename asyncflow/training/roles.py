"""Starting a recipe's roles: each declared role becomes a worker group on the ranks of its
placement side (one group per rank for the rollout instances), every worker built from the
run's config; then the weight-sync groups between the policy and each instance."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..resolved import ResolvedRun
from ..single_controller.driver import Driver, GroupSpec
from ..single_controller.protocol import Group
from ..workflow.stages import RecipeSpec
from .replicas import ReplicatedRole


@dataclass
class Placement:
    actor: list[int]
    rollout: list[int]

    @staticmethod
    def from_config(cfg: RunConfig) -> Placement:
        n = cfg.trainer.nproc
        if cfg.placement.mode == "colocated" or n == 1:
            return Placement(list(range(n)), list(range(n)))
        return Placement(list(cfg.placement.actor_ranks), list(cfg.placement.rollout_ranks))

    def ranks(self, on: str | list[int], nproc: int) -> list[int]:
        """The ranks of a role placed ``on`` a side ("actor", "rollout", "all") or given ranks."""
        if not isinstance(on, str):
            bad = [r for r in on if not 0 <= int(r) < nproc]
            if bad:
                raise ValueError(f"ranks {bad} lie outside 0..{nproc - 1} (trainer.nproc={nproc})")
            return sorted(int(r) for r in on)
        if on == "all":
            return list(range(nproc))
        return list(self.actor if on == "actor" else self.rollout)


@dataclass
class RunRoles:
    """The started worker groups of a run."""
    spec: RecipeSpec
    placement: Placement
    groups: dict[str, Group] = field(default_factory=dict)  # role -> group (not the per-rank roles)
    instances: list[Group] = field(default_factory=list)  # the rollout role's groups, one per rank

    @property
    def policy(self) -> Group:
        return self.groups[self.spec.policy]

    def with_method(self, name: str, instances: bool = False) -> list[Group]:
        """The groups whose worker class defines ``name`` (e.g. save_checkpoint, load_reference);
        with ``instances``, the rollout instances' groups too."""
        pool = self.all_groups() if instances else self.groups.values()
        return [g for g in pool if callable(getattr(g.cls, name, None))]

    def all_groups(self) -> list[Group]:
        return [*self.groups.values(), *self.instances]


async def start_roles(driver: Driver, run: ResolvedRun, spec: RecipeSpec, out: Path) -> RunRoles:
    """Create every role's group (policy first: its ranks lead), then the weight-sync groups.
    Each worker gets the resolved run in its wire form (``cfg``), rebuilt there unchecked."""
    cfg = run.config
    place = Placement.from_config(cfg)
    roles = RunRoles(spec, place)
    wire_cfg = run.to_wire()
    order = sorted(spec.roles, key=lambda r: (r != spec.policy, r))
    for name in order:
        role = spec.roles[name]
        cls = role.worker_class()
        ranks = place.ranks(role.on, cfg.trainer.nproc)
        if not ranks:
            raise ValueError(f"role {name!r} has no ranks (on={role.on!r}): check placement")
        if role.per_rank:
            # one instance per rank (each swaps weights on its own), all made in one call per rank
            roles.instances.extend(await driver.create_groups([
                GroupSpec(cls, f"{name}{k}", [r], None, {"cfg": wire_cfg, **role.options})
                for k, r in enumerate(ranks)]))
        elif replicated_beside_instances(cfg, role.on):
            # a rollout rank may be lost and replaced: one group per rank, called as one (replicas.py)
            members = await driver.create_groups([
                GroupSpec(cls, f"{name}{k}", [r], None, {"cfg": wire_cfg, **role.options})
                for k, r in enumerate(ranks)])
            f = cfg.fault
            roles.groups[name] = ReplicatedRole(driver, name, members,
                                                wait_s=f.max_backoff_s + 2 * f.rejoin_timeout_s)
        else:
            roles.groups[name] = await driver.create_group(cls, name, ranks=ranks, cfg=wire_cfg, **role.options)
    write_ranks(driver, roles, out)
    await init_weight_sync(roles.policy, roles.instances)
    return roles


def replicated_beside_instances(cfg: RunConfig, on: str | list[int]) -> bool:
    """A role on the rollout side of a run whose rollout instances are replaced when lost
    (fault.rollout_restarts): it is made per rank, so that a lost rank takes only its own
    worker with it (the config admits only a stateless role there: the reward)."""
    return bool(cfg.fault.rollout_restarts) and on == "rollout"


async def init_weight_sync(policy: Group, instances: Sequence[Group]) -> None:
    """One weight-sync group per training rank, its members that rank and every receiving
    endpoint of the instances outside the training ranks' processes (weight_sync/wire_group.py);
    all of them join together."""
    train = list(policy.ranks)
    counts = [sum(await inst.weight_endpoints(train)) for inst in instances]
    addrs = await policy.open_weight_sync(1 + sum(counts))
    bases = [1 + sum(counts[:i]) for i in range(len(instances))]
    await asyncio.gather(policy.init_weight_sync(any(c == 0 for c in counts)),
                         *(inst.init_weight_sync(train, addrs, base) for inst, base in zip(instances, bases)))


def write_ranks(driver: Driver, roles: RunRoles, out: Path) -> None:
    """ranks.json: which process (host, pid) serves which roles, for operators (and fault tests)."""
    by_rank: dict[int, list[str]] = {}
    for g in roles.all_groups():
        for r in g.ranks:
            by_rank.setdefault(r, []).append(g.role)
    info = [{"rank": ep.rank, "host": ep.info.get("host"), "pid": ep.info.get("pid"),
             "roles": by_rank.get(ep.rank, [])}
            for ep in driver.ranks if getattr(ep, "info", None)]
    (out / "ranks.json").write_text(json.dumps(info, indent=1))
