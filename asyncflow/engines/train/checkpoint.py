"""Checkpoints of a training engine: sharded model + optimizer through
torch.distributed.checkpoint (DCP), plus scheduler, step, per-rank RNG and caller data.

Layout of a checkpoint directory:

    dcp/              DCP files: {"model": ..., "optim": ...}, each rank writes its shards
    meta.pt           written by rank 0: step, scheduler, extra, world size
    rng/rank{r}.pt    RNG state (python, numpy, torch CPU, device) of rank r

Atomic: every rank writes into `.<name>.tmp` next to the target (a filesystem shared by
all ranks of the group), the ranks agree that every write succeeded, and only then rank 0
renames the temp dir to the target. On any failure all ranks raise, the temp dir is
removed and a previous checkpoint at the target is left as it was.

`extra` and `meta.pt` are pickled: load checkpoints you wrote yourself only.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from asyncflow.platform import Platform

__all__ = ["capture_rng_state", "gather_errors", "load_checkpoint", "restore_rng_state", "save_checkpoint"]

FORMAT_VERSION = 1


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather_errors(error: str | None, group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's error message (or none), known to every rank, 'rank r: msg' each.

    A collective (bounded by the group's timeout): lets all ranks fail together
    instead of some waiting forever in the next collective.
    """
    if group is None:
        return [f"rank 0: {error}"] if error else []
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, error, group=group)
    return [f"rank {r}: {e}" for r, e in enumerate(gathered) if e]


def capture_rng_state(platform: Platform) -> dict[str, Any]:
    """The RNG states of python, numpy, torch CPU and the current device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    state["numpy"] = np.random.get_state()
    if platform.is_accelerator:
        state["device"] = getattr(torch, platform.name).get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], platform: Platform) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if platform.is_accelerator and "device" in state:
        getattr(torch, platform.name).set_rng_state(state["device"])


@contextlib.contextmanager
def _quiet_single_process(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Silence DCP's 'assuming single process' warning, which is the intent when group is None."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _tmp_path(target: Path) -> Path:
    return target.parent / f".{target.name}.tmp"


def _publish(tmp: Path, target: Path) -> None:
    """Rename tmp to target; an existing target is replaced only once tmp is complete."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = target.parent / f".{target.name}.old"
    if old.exists():
        shutil.rmtree(old)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(old, target)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _root_cause(exc: BaseException) -> str:
    """The innermost OS-level cause (e.g. 'No space left on device'), not DCP's wrapper text."""
    failures = getattr(exc, "failures", None)  # CheckpointException: {rank: exception}
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # an exception, or (exception, traceback)
        first = next((x for x in first if isinstance(x, BaseException)), None) if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            exc = first
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)


def save_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, step: int, extra: dict[str, Any] | None,
                    process_group: dist.ProcessGroup | None, platform: Platform) -> None:
    """Save atomically (see module docstring). Collective: every rank of the group calls it
    with the same path."""
    # torch.distributed.checkpoint is slow to import: only runs that save or load pay for it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _rank_world(process_group)
    target = Path(path).absolute()
    tmp = _tmp_path(target)
    error: str | None = None
    if rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by an earlier crash
            (tmp / "rng").mkdir(parents=True)
        except OSError as exc:
            error = f"cannot create temp dir {tmp}: {type(exc).__name__}: {exc}"
    errors = gather_errors(error, process_group)
    if errors:
        raise RuntimeError(f"save_checkpoint({target}) failed, nothing written: " + "; ".join(errors))

    error = None
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _quiet_single_process(process_group):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"),
                     process_group=process_group, no_dist=process_group is None)
        torch.save(capture_rng_state(platform), tmp / "rng" / f"rank{rank}.pt")
        if rank == 0:
            meta = {"format": FORMAT_VERSION, "step": step, "world_size": world,
                    "scheduler": scheduler.state_dict(), "extra": extra or {}}
            torch.save(meta, tmp / "meta.pt")
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported to every rank below
        error = f"{type(exc).__name__}: {_root_cause(exc)}"
    errors = gather_errors(error, process_group)
    if not errors and rank == 0:
        try:
            _publish(tmp, target)
        except OSError as exc:
            error = f"cannot rename {tmp} to {target}: {type(exc).__name__}: {exc}"
        errors = gather_errors(error, process_group)
    elif not errors:
        errors = gather_errors(None, process_group)
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"save_checkpoint({target}) failed; any previous checkpoint there is "
                           "untouched: " + "; ".join(errors))


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, process_group: dist.ProcessGroup | None,
                    platform: Platform) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and this rank's RNG in place; returns
    (step, extra). Collective. The group must have the world size it was saved with
    (RNG states are per rank)."""
    import torch.distributed.checkpoint as dcp  # slow to import: only when used (see save_checkpoint)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _rank_world(process_group)
    target = Path(path).absolute()
    meta: dict[str, Any] = {}
    error = None
    try:
        for needed in (target / "meta.pt", target / "dcp", target / "rng" / f"rank{rank}.pt"):
            if not needed.exists():
                raise FileNotFoundError(f"{needed} is missing: not a complete checkpoint")
        meta = torch.load(target / "meta.pt", weights_only=False)
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"checkpoint format {meta.get('format')!r}, expected {FORMAT_VERSION}")
        if meta["world_size"] != world:
            raise ValueError(f"checkpoint saved by {meta['world_size']} ranks, loading with {world}")
        rng = torch.load(target / "rng" / f"rank{rank}.pt", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    errors = gather_errors(error, process_group)
    if errors:
        raise RuntimeError(f"load_checkpoint({target}) failed: " + "; ".join(errors))

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process(process_group):
        dcp.load(state, checkpoint_id=str(target / "dcp"), process_group=process_group,
                 no_dist=process_group is None)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    restore_rng_state(rng, platform)
    return int(meta["step"]), meta["extra"]
