"""Colocated placement on a real 2-rank cluster: the actor (FSDP2 over both ranks) and a
builtin-engine rollout instance per rank take turns. While the actor runs, the rollout engines
that were built with offload=True are released (generate refuses, no KV cache held, weights
kept); when the rollout role runs again they generate as before, and weight sync from the
actor still reaches them. A rollout built without offload (disaggregated placement) is left
alone by the same role switches."""
from __future__ import annotations

import asyncio

import _offload_workers as W
import pytest
from _sc_cluster import cluster_fixture

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]
cluster2 = cluster_fixture(2)


def _model_path() -> str:
    from asyncflow.config import load_config
    from asyncflow.training.trainer import resolve_model
    return resolve_model(load_config())


def test_rollout_memory_is_released_while_the_actor_runs(cluster2):
    from asyncflow.config import load_config, to_dict
    from asyncflow.training.roles import init_weight_sync

    d, path = cluster2.driver, _model_path()
    common = [f"model.path={path}", "trainer.threads=1", "workflow.mode=sync", "optim.lr=0.01",
              "optim.warmup_steps=0", "rollout.max_new_tokens=6"]
    colocated = to_dict(load_config(overrides=[*common, "placement.mode=colocated"]))  # idle roles offload
    apart = to_dict(load_config(overrides=common))  # disaggregated placement: nothing offloads
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    async def go():
        actor = await d.create_group(W.ProbingActor, "actor", cfg=colocated)
        insts = [await d.create_group(W.ProbedRollout, f"rollout{r}", ranks=[r], cfg=colocated) for r in (0, 1)]
        plain = await d.create_group(W.ProbedRollout, "plain", ranks=[0], cfg=apart)
        await init_weight_sync(actor, insts)  # colocated: each instance takes its rank's tensors in process
        before = [await i.evaluate(prompts, ["0"] * 3, samples=3) for i in insts]
        await plain.version()
        seen = await actor.look_at_rollouts()
        again = [await i.evaluate(prompts, ["0"] * 3, samples=3) for i in insts]
        # Train, publish (the actor is onloaded for it), take the weights on the rollout side.
        await actor.sft_step([[5, 6], [7, 8]], [[9], [10]])
        await asyncio.gather(*(i.receive_weights(1) for i in insts))
        await actor.publish_weights(1)
        for i in insts:
            await i.swap_weights(1)
        synced = [await i.evaluate(prompts, ["0"] * 3, samples=3) for i in insts]
        sums = [(await i.weights_checksum())[0] for i in insts]
        return before, seen, again, synced, sums, (await actor.weights_checksum())[0]

    before, seen, again, synced, sums, actor_sum = cluster2.run(go(), timeout=120)
    by_rank = {r: {s["role"]: s for s in seen[r]} for r in (0, 1)}
    assert set(by_rank[0]) == {"rollout0", "plain"} and set(by_rank[1]) == {"rollout1"}
    for r in (0, 1):
        held = by_rank[r][f"rollout{r}"]
        assert held["refused"] and held["kv_cache"] == 0 and held["weights"] > 0
    assert not by_rank[0]["plain"]["refused"]  # built without offload: the switches leave it alone
    # Resumed: the same (greedy) responses as before the actor ran.
    assert [b["examples"] for b in before] == [a["examples"] for a in again]
    assert [s["version"] for s in synced] == [1, 1]
    assert sums == pytest.approx([actor_sum] * 2, rel=1e-6)  # the trained weights arrived on both ranks
