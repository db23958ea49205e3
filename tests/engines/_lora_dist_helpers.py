"""The body of the spawned 2-rank LoRA children (importable by `spawn`): LoRA on FSDP2 over
two ranks, trained, its merged tensors and its fold, for tests/engines/test_train_lora_dist.py."""
from __future__ import annotations

from pathlib import Path

from tests.engines._train_helpers import GLOBAL_N, RANK_SHARES, _run_rank, make_batch, ppo_loss, split_batch, tiny_model

LORA_RANK, LORA_ALPHA, LR, STEPS = 4, 8.0, 1e-2, 3


def lora_engine(group=None, platform=None):
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.engines.train.lora import LoraOptions

    return FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=LR), process_group=group, platform=platform,
                      lora=LoraOptions(rank=LORA_RANK, alpha=LORA_ALPHA))


def train(engine, idx: list[int]) -> None:
    """STEPS steps on rows ``idx`` of the global batch (a rank's share, or all of them)."""
    batch = split_batch(*make_batch(GLOBAL_N, seed=1), idx)
    for _ in range(STEPS):
        engine.train_step(*batch, ppo_loss)


def whole(named) -> dict:
    """(name, tensor) pairs as whole CPU tensors (a DTensor gathered: a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu", copy=True) for k, v in named}


def lora_dist_child(rank: int, world: int, workdir: str) -> None:
    _run_rank(rank, world, workdir, _lora_scenario)


def _lora_scenario(rank: int, group, workdir: Path) -> dict:
    from asyncflow.engines.train.lora import merged_tensors
    from asyncflow.platform import get_platform
    from asyncflow.weight_sync.shards import local_tensors

    engine = lora_engine(group, get_platform("cpu"))
    train(engine, RANK_SHARES[rank])
    named = local_tensors(engine.model)
    merged = merged_tensors(engine.model, named, engine.lora.scale)
    out = {"sharded": sorted(k for k, v in merged if hasattr(v, "to_local")), "merged": whole(merged),
           "state": engine.full_state_dict()}
    prompts, responses, _ = make_batch(GLOBAL_N, seed=2)
    mine = split_batch(prompts, responses, {}, RANK_SHARES[rank])
    out["log_probs"] = engine.compute_log_probs(mine[0], mine[1])[0]
    out["folded_layers"] = engine.fold_adapters()
    out["folded_state"] = engine.full_state_dict()
    out["folded_log_probs"] = engine.compute_log_probs(mine[0], mine[1])[0]
    out["folded_base_log_probs"] = engine.compute_log_probs(mine[0], mine[1], adapters=False)[0]
    return out
