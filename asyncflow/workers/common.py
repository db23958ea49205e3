"""Helpers shared by the role workers: columns <-> lists of tensors, model loading, shares."""
from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from ..config import RunConfig, from_dict, rank_threads
from ..engines.train import FSDPEngine, MindSpeedEngine
from ..engines.train.model_source import PretrainedModel
from ..engines.train.options import EngineOptions
from ..resolved import WIRE_KEY, ResolvedRun, is_wire, resolve_run
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta

# rows: also the import path docs/recipes.md gives custom workers (with resolved_of, config_of, setup_rank)
from ..transfer_queue.row_lists import rows
from ..workflow.stages import StageIO


def resolved_of(cfg: Any, platform: str = "cpu") -> ResolvedRun:
    """The resolved run a worker is built with. The driver sends the launcher's, in its wire
    form: rebuilt here, nothing checked or resolved again. A worker built by hand (a test, a
    driver of your own) with a plain config (the tree or its dict) gets its values derived
    here, on ``platform`` (the worker's ``self.platform.name``)."""
    if isinstance(cfg, ResolvedRun):
        return cfg
    if is_wire(cfg):
        return ResolvedRun.from_wire(cfg)
    return resolve_run(cfg if isinstance(cfg, RunConfig) else from_dict(cfg), platform)


def config_of(cfg: Any) -> RunConfig:
    """The run's config as the dataclass tree (a worker receives it as a dict)."""
    if isinstance(cfg, ResolvedRun):
        return cfg.config
    if is_wire(cfg):
        return from_dict(cfg[WIRE_KEY]["config"])
    return cfg if isinstance(cfg, RunConfig) else from_dict(cfg)


def setup_rank(run: ResolvedRun | RunConfig) -> None:
    """What every role worker does first: torch threads (the resolved run's ``rank_threads``),
    the config's ``imports``. Given a bare config (a custom worker's ``config_of(cfg)``), the
    threads are derived here by the same rule."""
    if isinstance(run, ResolvedRun):
        set_threads(run.derived.rank_threads)
        import_modules(list(run.config.imports))
    else:
        set_threads(rank_threads(run))
        import_modules(list(run.imports))


def policy_model(cfg: Any) -> Any:
    """The policy's model for a training engine (``model.path``, set by the launcher, its attention
    and the engine keys of the ``model`` section): built on the meta device, loaded shard by shard."""
    return PretrainedModel(cfg.model.path, cfg.model.attn_implementation or None,
                           options=EngineOptions.from_model_config(cfg.model))


def engine_optim(cfg: Any, section: str = "optim", phase: str = "rl") -> Any:
    """The training engine's optimizer settings: the config section ``section`` ("optim",
    "critic_optim"); for RL the cosine (min_lr_ratio < 1) spans trainer.steps unless the
    section sets total_steps; the supervised warm-up takes warmup.lr at a constant rate after
    its own warm-up steps."""
    o = getattr(cfg, section)
    if phase == "warmup":
        w = cfg.warmup
        return dataclasses.replace(o, lr=w.lr, warmup_steps=w.warmup_steps, min_lr_ratio=1.0, total_steps=0)
    if phase != "rl":
        raise ValueError(f"optimizer phase {phase!r}: expected rl or warmup")
    return dataclasses.replace(o, total_steps=o.total_steps or max(cfg.trainer.steps, o.warmup_steps))


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def import_modules(names: list[str]) -> None:
    """The run's ``imports``: user modules that register rewards, advantages, losses."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"config imports: cannot import {name!r} in this worker: {e}") from e


def train_engine_class(name: str) -> type:
    engines = {"fsdp": FSDPEngine, "mindspeed": MindSpeedEngine}
    if name not in engines:
        raise ValueError(f"model.train_engine {name!r}: expected one of {sorted(engines)}")
    return engines[name]


def share_of(meta: BatchMeta, dp_rank: int, dp_size: int) -> BatchMeta:
    """This data-parallel rank's part of a batch (ranks that get no rows still take part in
    the collectives of the step)."""
    return meta.part(dp_size, dp_rank)


def share_column(worker: Worker, meta: BatchMeta, io: StageIO,
                 compute: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]) -> None:
    """This rank's share of ``meta``: fetch its prompts and responses (the stage's first two
    input columns), compute the stage's output column from them, write it to those rows. A
    rank with no rows still calls ``compute`` (empty lists): sharded engines need every rank
    in their collectives."""
    if len(io.inputs) < 2 or len(io.outputs) != 1:
        raise ValueError(f"role {worker.role!r} rank {worker.rank}: this method reads [prompt, response] "
                         f"columns first and writes one column; the stage declares {io.inputs} -> {io.outputs}")
    prompt_col, response_col = io.inputs[:2]
    mine = meta.part(worker.dp_size, worker.dp_rank)
    data = worker.tq.get_columns(mine, [prompt_col, response_col]) if len(mine) else None  # rows() reads them
    prompts = rows(data[prompt_col]) if data is not None else []
    responses = rows(data[response_col]) if data is not None else []
    out = compute(prompts, responses)
    if len(mine):
        worker.tq.put({io.outputs[0]: out}, mine.partition, mine)


def per_token_column(worker: Worker, meta: BatchMeta, io: StageIO,
                     compute: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """``share_column`` for one float32 value per response token."""
    share_column(worker, meta, io, lambda p, r: [x.float() for x in compute(p, r)])


def pad(seqs: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors to [B, T]; returns (padded, mask)."""
    n = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), n), value, dtype=seqs[0].dtype if seqs else torch.float32)
    mask = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
        mask[i, :len(s)] = True
    return out, mask


def unpad(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [x[i][mask[i]] for i in range(x.shape[0])]


class EngineCheckpoints:
    """A worker's training engine (model, optimizer, LR schedule, RNG per rank) into and out
    of a run checkpoint. Mixed into the workers that train (actor, critic)."""

    # A TrainEngine; Any because the actor also calls what only some engines have (the FSDP
    # engine's model, train_part and base_changed; compute_log_probs' adapters switch), which the
    # TrainEngine ABC lacks.
    engine: Any

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.engine.save_checkpoint(path, extra)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        return self.engine.load_checkpoint(path)


class EngineOffload:
    """Colocated roles take turns on a rank (the runtime calls ``offload`` on the role that
    ran last and ``onload`` on the next): the idle role's engine frees its device memory
    (``_free_engine``: a training engine's ``offload``, a rollout engine overrides it).
    Mixed into the workers that hold an engine.

    Only when the worker was built with ``offload=True`` (``offload_idle``), i.e. colocated
    placement: in disaggregated placement the reference and reward roles share ranks with the
    actor or the rollout too, and moving memory at each of those switches would cost time to
    free memory that no one is waiting for.
    """

    engine: Any
    offload_idle: bool = False

    def offload(self) -> None:
        if self.offload_idle:
            self._free_engine()

    def onload(self) -> None:
        if self.offload_idle:
            self._restore_engine()

    def _free_engine(self) -> None:
        self.engine.offload()

    def _restore_engine(self) -> None:
        self.engine.onload()

    def start_idle(self, offload: bool) -> None:
        """End of ``__init__``: with ``offload``, start offloaded. A role that has not run yet
        is idle too, and the runtime onloads a role before its first method runs."""
        self.offload_idle = bool(offload)
        self.offload()
