"""The body of test_train_scale_dist's spawned 2-rank children (importable by `spawn`): meta-device
build and sharded loading, padding-free + activation checkpointing, CPU offload, a reward model
from a plain loader."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engines._train_helpers import RANK_SHARES, _run_rank, loss_mask_batch, ppo_loss, split_batch, tiny_model

SCALE_BUDGET = 24  # tokens per micro-batch: several micro-batches per rank


def scale_child(rank: int, world: int, workdir: str) -> None:
    _run_rank(rank, world, workdir, _scale_scenarios)


def _scale_scenarios(rank: int, group, workdir: Path) -> dict:
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.engines.train.meta_init import shard_rows
    from asyncflow.engines.train.model_source import PretrainedModel
    from asyncflow.engines.train.options import EngineOptions
    from asyncflow.models.loading import load_reward_model
    from asyncflow.platform import get_platform

    cpu = get_platform("cpu")
    out: dict = {}
    engine = FSDPEngine(PretrainedModel(str(workdir / "ckpt")), OptimConfig(lr=1e-3), process_group=group,
                        platform=cpu)
    model = engine.model
    out["pretrained"] = {
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "shards": {n: (shard_rows(p), p.to_local().detach().clone()) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "state": engine.full_state_dict(),
        "counts": engine.load_counts,
    }
    del engine, model
    try:  # a checkpoint without one tensor: every rank raises (none is left waiting in a broadcast)
        FSDPEngine(PretrainedModel(str(workdir / "broken")), OptimConfig(lr=1e-3), process_group=group, platform=cpu)
        out["broken"] = "no error"
    except KeyError as exc:
        out["broken"] = str(exc)

    batch = split_batch(*loss_mask_batch(), RANK_SHARES[rank])
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=SCALE_BUDGET)
    for name, options in {"packed_ac": EngineOptions(padding_free=True, activation_checkpointing=True),
                          "offload": EngineOptions(cpu_offload=True)}.items():
        e = FSDPEngine(lambda: tiny_model(seed=0), cfg, process_group=group, platform=cpu, options=options)
        metrics = e.train_step(*batch, ppo_loss, with_entropy=True)
        log_probs, _ = e.compute_log_probs(batch[0], batch[1])
        out[name] = {"metrics": metrics, "state": e.full_state_dict(), "log_probs": log_probs,
                     "param_devices": sorted({p.to_local().device.type for p in e.model.parameters()})}

    rm = workdir / "rm"
    critic = FSDPEngine(lambda: load_reward_model(rm), OptimConfig(lr=1.0), process_group=group, platform=cpu,
                        value_head=True)
    out["reward"] = {"values": critic.compute_values(batch[0], batch[1]), "state": critic.full_state_dict()}
    return out


def save_reward_model(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0,
                      attn_implementation="eager")
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_()
    model.save_pretrained(path)
