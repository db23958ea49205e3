"""The body of the spawned 2-rank child of test_train_offload (importable by `spawn`)."""
from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch


def fsdp2_move_child(rank: int, world: int, workdir: str) -> None:
    """FSDP2 (DTensor parameters and optimizer state) through move_train_state: to the same
    device (nothing moves), then one way to 'meta', the only other device a CPU machine has.
    Rank r writes what it saw to workdir/rank{r}.pt."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        from asyncflow.engines.train import FSDPEngine, OptimConfig
        from asyncflow.engines.train.base import move_train_state
        from asyncflow.platform import get_platform
        from tests.engines._train_helpers import make_batch, ppo_loss, split_batch, tiny_model

        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), process_group=group,
                            platform=get_platform("cpu"))
        prompts, responses, fields = make_batch(6, seed=1)
        engine.train_step(*split_batch(prompts, responses, fields, [rank, rank + 2, rank + 4]), ppo_loss)
        params = list(engine.model.parameters())
        out["dtensor"] = all(hasattr(p, "to_local") for p in params)
        out["same_device"] = move_train_state(engine.model, engine.optimizer, "cpu")
        local = [p.to_local() for p in params] + [p.grad.to_local() for p in params if p.grad is not None]
        state = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
        out["expected"] = (sum(t.numel() * t.element_size() for t in local)
                           + sum(v.to_local().numel() * v.element_size() for v in state)
                           + sum(b.numel() * b.element_size() for b in engine.model.buffers()))
        out["moved"] = move_train_state(engine.model, engine.optimizer, "meta")
        now = list(engine.model.parameters())
        out["devices"] = sorted({str(p.to_local().device) for p in now}
                                | {str(p.grad.to_local().device) for p in now if p.grad is not None}
                                | {str(v.device) for s in engine.optimizer.state.values()
                                   for v in s.values() if v.dim() > 0})
        out["steps_on"] = sorted({str(s["step"].device) for s in engine.optimizer.state.values()})
        in_opt = [p for g in engine.optimizer.param_groups for p in g["params"]]
        out["optimizer_follows"] = (len(in_opt) == len(now) and all(a is b for a, b in zip(in_opt, now))
                                    and {id(p) for p in engine.optimizer.state} == {id(p) for p in now})
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"error": traceback.format_exc()}
    torch.save(out, Path(workdir) / f"rank{rank}.pt")
