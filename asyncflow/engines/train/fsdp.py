"""FSDP2 training engine: a HF causal LM (or critic) sharded with `fully_shard`.

One engine per data-parallel rank. With `process_group=None` it is a plain single-rank
engine (no sharding wrapper, collectives become no-ops); otherwise each decoder layer
and then the root are wrapped with `fully_shard` over a 1-D DeviceMesh built from the
group. Every collective runs on that group and is bounded by its timeout.

Build: the model is built with its parameters on the meta device, optionally checkpointed
per decoder layer, sharded, and only then allocated, each rank filling its own shard
(meta_init.py, model_source.py): no rank holds the whole model on its device. Options
(options.py): the dtype parameters are gathered in (bf16 on accelerators by default; master
weights, gradient reduction and AdamW stay fp32), activation checkpointing, FSDP2's CPU
offload, padding-free micro-batches (packing.py).

Per train_step:
1. LossNorm (global model tokens and sequences with one: the response tokens unless the
   per-token "loss_mask" field drops tool/environment tokens, see base.py): all_reduce SUM.
2. Micro-batches by token budget (microbatch.py); the ranks agree on the count with
   all_reduce MAX and a rank with fewer runs empty placeholder micro-batches (zero loss,
   but forward + backward run, so FSDP's all-gathers/reduce-scatters line up).
3. For each micro-batch: forward, fp32 log-probs of the response tokens, loss_fn,
   backward of loss * world_size. Why the factor: loss_fn normalises by the GLOBAL
   counts, so the full-batch loss is the SUM of the per-rank losses and its gradient
   the SUM of the per-rank gradients; FSDP's reduce-scatter AVERAGES gradients over the
   ranks, so each rank scales by world_size to turn that mean back into the sum.
   Result: a 2-rank step equals a 1-rank step on the same global batch.
4. clip_grad_norm_ (on DTensors with FSDP), AdamW step, LR schedule step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from asyncflow.engines.train import checkpoint as ckpt
from asyncflow.engines.train.activation_checkpoint import checkpoint_layers
from asyncflow.engines.train.base import (
    LossFn,
    LossNorm,
    NonFiniteUpdateError,
    OptimConfig,
    TrainEngine,
    check_batch,
    move_train_state,
    response_loss_masks,
)
from asyncflow.engines.train.critic_init import critic_model
from asyncflow.engines.train.lora import (
    LoraOptions,
    fold_adapters,
    hf_name,
    initial_adapters,
    is_adapter,
    merge_state_dict,
    save_adapter,
    wrap,
)
from asyncflow.engines.train.meta_init import fill, materialize, real_tensors
from asyncflow.engines.train.microbatch import (
    MicroBatch,
    build_micro_batch,
    empty_micro_batch,
    plan_micro_batches,
    slice_fields,
)
from asyncflow.engines.train.model_source import ModelSource, as_model_source
from asyncflow.engines.train.options import EngineOptions
from asyncflow.engines.train.packing import (
    ROW_TOKENS,
    build_packed_micro_batch,
    check_packing_supported,
    flash_kwargs,
    plan_packed_micro_batches,
)
from asyncflow.engines.train.schedule import build_scheduler
from asyncflow.models.loading import record_attn_implementation
from asyncflow.platform import Platform, get_platform

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FSDPEngine", "adapter_path", "decoder_layers"]

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a HF model: the first ModuleList whose name ends in 'layers'."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return list(module)
    raise ValueError(f"{type(model).__name__} has no ModuleList named '*layers' to shard per layer")


def _tensors(state: dict[str, Any]) -> dict[str, Tensor]:
    """A model state dict (torch's ValueType) as the tensors it holds; raise for anything else."""
    odd = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if odd:
        raise TypeError(f"model state dict: {odd[:3]} hold no tensor ({type(state[odd[0]]).__name__})")
    return state


def adapter_path(model_path: str | Path) -> Path:
    """Where a LoRA engine's export_hf(model_path) writes the PEFT adapter directory."""
    p = Path(model_path)
    return p.with_name(p.name + "_adapter")


class FSDPEngine(TrainEngine):
    """See the module docstring.

    model: a ModelSource (model_source.py; e.g. PretrainedModel(path), which the workers pass)
        or a callable building the model (the group's first rank builds it with weights, which
        every rank receives; the others build it on the meta device). Either way the model is
        sharded on the meta device and each rank then allocates and fills only its shard
        (meta_init.py).
    options: param dtype, activation checkpointing, CPU offload, padding-free micro-batches
        (options.py); None: the ModelSource's own options, else the defaults.
    mixed_precision: overrides options.param_dtype when given (True: bf16, False: fp32); None =>
        options.param_dtype ('auto': bf16 params / fp32 reduce on accelerators, fp32 on CPU).
    value_head: wrap the model in ValueModel and act as a critic: compute_values works,
        and loss_fn's first argument is the values tensor [b, T] instead of log-probs.
    lora: train LoRA adapters (lora.py) instead of every weight: the base is frozen and
        sharded like the adapters, only the adapters get gradients and optimizer state, and
        ``compute_log_probs(..., adapters=False)`` is the base model (the reference).
    """

    guards_weight_writes = True  # _weights_change() before every write of the parameters

    def __init__(self, model_factory: ModelSource | Callable[[], nn.Module], optim: OptimConfig, *,
                 process_group: dist.ProcessGroup | None = None, platform: Platform | None = None,
                 mixed_precision: bool | None = None, value_head: bool = False,
                 options: EngineOptions | None = None, lora: LoraOptions | None = None) -> None:
        if lora is not None and value_head:
            raise ValueError("LoRA is for the policy: a critic engine (value_head=True) trains every weight")
        self.lora = lora
        self.base_changed = True  # LoRA: the base weights changed since the last weight sync (a full one is due)
        self.trains_base = False  # LoRA: the base trains and the adapters rest (train_part("base"))
        self.optim_config = optim
        self.platform = platform if platform is not None else get_platform("auto")
        self.process_group = process_group
        self.value_head = value_head
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = self.platform.device_for_local_rank(local_rank)
        self.platform.set_device(self.device)
        source = as_model_source(model_factory)
        self.options = options or getattr(source, "options", None) or EngineOptions()
        if mixed_precision is not None:
            self.options = dataclasses.replace(self.options, param_dtype="bfloat16" if mixed_precision else "float32")
        self.compute_dtype = self.options.compute_dtype(self.platform.is_accelerator)
        self.mixed_precision = self.compute_dtype != torch.float32
        if self.options.cpu_offload and process_group is None:
            raise ValueError("model.cpu_offload needs a sharded engine (a process group): FSDP2's offload policy "
                             "does the offloading; turn it off for a single-rank engine")
        if self.options.padding_free:
            check_packing_supported()
        self.step = 0
        self.nonfinite_in_row = 0  # skipped updates since the last good one

        self.model = self._build(source)
        self.optimizer = self._adamw(optim)
        self.scheduler = build_scheduler(self.optimizer, optim)

    def reset_optimizer(self, optim: OptimConfig) -> None:
        """A fresh AdamW and schedule from step 0 on the current weights (e.g. RL after a
        supervised warm-up, which wants another learning rate and its own warm-up)."""
        self.optim_config = optim
        self.optimizer = self._adamw(optim)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.step = 0

    def train_part(self, part: str) -> None:
        """LoRA: which weights train from now on, "adapters" (the base frozen: LoRA's own mode)
        or "base" (every base weight, the adapters frozen: a supervised stage that makes the
        base, as the SFT that precedes LoRA RL would). Takes effect with the next
        ``reset_optimizer``, whose AdamW holds only the weights that train."""
        if self.lora is None:
            raise TypeError("train_part needs a LoRA engine (lora=LoraOptions(...))")
        if part not in ("adapters", "base"):
            raise ValueError(f"train_part: 'adapters' or 'base', got {part!r}")
        self.trains_base = part == "base"
        for name, p in self.model.named_parameters():
            p.requires_grad_(is_adapter(name) != self.trains_base)

    def _adamw(self, optim: OptimConfig) -> torch.optim.AdamW:
        """AdamW with torch's fused kernel where it has one (CPU, CUDA): the default per-tensor
        loop dispatches every op through DTensor, a large share of a small model's step."""
        fused = True if self.device.type in ("cpu", "cuda") else None
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                 weight_decay=optim.weight_decay, fused=fused)

    def load_model_state(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the weights with a full (unsharded, HF-named) state dict, on every rank."""
        # torch.distributed.checkpoint is slow to import: only runs that load a state pay for it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        if self.lora is not None:
            raise TypeError("load_model_state on a LoRA engine: its names are PEFT's; load a checkpoint instead")
        self._weights_change()
        self.base_changed = True
        full: dict[str, Any] = dict(state_dict)  # torch's ValueType admits tensors among other values
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))

    def _weights_change(self) -> None:
        """The parameters' memory is about to be written: whoever reads it still is done first."""
        if self.before_weights_change is not None:
            self.before_weights_change()

    # ---------------------------------------------------------------- setup
    def _build(self, source: ModelSource) -> nn.Module:
        """Build on meta, shard, allocate this rank's shards, fill them (meta_init.py)."""
        model = source.build(self.rank)
        self.hf_config = getattr(model, "config", None)
        self.hf_class = type(model)
        source_names: dict[str, str] = {}
        initial: dict[str, Tensor] = {}
        if self.value_head:
            model, source_names, initial = critic_model(model)
        if self.lora is not None:  # before sharding: FSDP2 shards the frozen base and the adapters alike
            model = wrap(model, self.lora)
            source_names = {name: hf_name(name) for name, _ in model.named_parameters()}
            initial = initial_adapters(model, seed=0) if self.rank == 0 else {}
        rank0_tensors = {**initial, **real_tensors(model)}  # the full tensors this rank holds, before sharding
        if self.options.activation_checkpointing:
            checkpoint_layers(decoder_layers(model))
        if self.process_group is not None:
            model = self._shard(model, self.process_group)
        # With CPU offload the shards live in host memory; FSDP2 moves them for compute.
        materialize(model, torch.device("cpu") if self.options.cpu_offload else self.device)
        with source.weights() as reader:
            counts = fill(model, reader=reader, source_names=source_names, rank0_tensors=rank0_tensors,
                          group=self.process_group, device=self.device, where=source.where, rank=self.rank)
        del rank0_tensors
        self.load_counts = counts  # tensors read by this rank / broadcast from the first rank
        log.info("rank %d: %s: %d tensors read, %d broadcast from the first rank", self.rank, source.where,
                 counts["read"], counts["broadcast"])
        return model

    def _shard(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        # torch.distributed.fsdp is slow to import: only sharded runs pay for it
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = DeviceMesh.from_group(group, device_type=self.device.type)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        offload = (CPUOffloadPolicy(pin_memory=self.platform.is_accelerator) if self.options.cpu_offload
                   else OffloadPolicy())
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        return model

    # ---------------------------------------------------------------- collectives
    def _all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.process_group is not None:
            dist.all_reduce(t, op=op, group=self.process_group)
        return t.tolist()

    def _plan(self, prompts: list[Tensor], responses: list[Tensor]) -> tuple[list[list[int]], int]:
        """This rank's micro-batches and the count every rank runs (max over ranks)."""
        lengths = [p.numel() + r.numel() for p, r in zip(prompts, responses)]
        overhead = self.optim_config.micro_batch_overhead_tokens
        if self.options.padding_free:  # rows packed near full (row_packing): the fewest micro-batches by real tokens
            groups = plan_packed_micro_batches(lengths, self.optim_config.micro_batch_tokens, self._row_tokens())
        else:
            groups = plan_micro_batches(lengths, self.optim_config.micro_batch_tokens,
                                        overhead if overhead >= 0 else None)
        count = int(self._all_reduce([float(len(groups))], dist.ReduceOp.MAX)[0])
        return groups, count

    def _micro_batch(self, prompts: list[Tensor], responses: list[Tensor], indices: list[int],
                     loss_masks: list[Tensor] | None = None) -> MicroBatch:
        if self.options.padding_free:
            return build_packed_micro_batch(prompts, responses, indices, loss_masks=loss_masks,
                                            row_tokens=self._row_tokens())
        return build_micro_batch(prompts, responses, indices, loss_masks=loss_masks)

    def _row_tokens(self) -> int:
        """Packed rows' length: flash kernels take one row and its cumulative lengths (0); eager
        and SDPA score a row's whole block, so rows of about ROW_TOKENS."""
        flash = "flash" in (getattr(self.hf_config, "_attn_implementation", None) or "")
        return 0 if flash else ROW_TOKENS

    # ---------------------------------------------------------------- forward
    def _forward(self, mb: MicroBatch, temperature: float,
                 with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """(log-probs or values [b, R] fp32, entropy [b, R] or None), both 0 wherever mb.mask is
        False (padding, and tokens a loss mask drops: no gradient reaches the model from there)."""
        mb = mb.to(self.device)
        # Row of each sequence's outputs: its own, or the packed row that holds it.
        rows = mb.rows if mb.packed else torch.arange(mb.input_ids.shape[0], device=self.device)[:, None]
        extra = flash_kwargs(mb, getattr(self.hf_config, "_attn_implementation", None))
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                    if self.mixed_precision and self.process_group is None else contextlib.nullcontext())
        with autocast:
            if self.value_head:
                # (ValueModel takes no attention kwargs: flash kernels find packed rows from position_ids)
                values = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                    position_ids=mb.position_ids)
                return values[rows, mb.logit_pos].float().masked_fill(~mb.mask, 0.0), None
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                position_ids=mb.position_ids, use_cache=False, **extra).logits
        # Only the response positions: [b, R, V] in fp32.
        logits = logits[rows, mb.logit_pos].float()
        if temperature != 1.0:
            logits = logits / temperature
        log_probs_all = F.log_softmax(logits, dim=-1)
        log_probs = log_probs_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        log_probs = log_probs.masked_fill(~mb.mask, 0.0)
        entropy = None
        if with_entropy:
            entropy = -(log_probs_all.exp() * log_probs_all).sum(-1).masked_fill(~mb.mask, 0.0)
        return log_probs, entropy

    @torch.no_grad()
    def _infer(self, prompts: list[Tensor], responses: list[Tensor], temperature: float,
               with_entropy: bool) -> tuple[list[Tensor], list[Tensor] | None]:
        check_batch(prompts, responses)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        groups, count = self._plan(prompts, responses)
        out: list[Tensor | None] = [None] * len(prompts)
        ent: list[Tensor | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            for i in range(count):
                mb = (self._micro_batch(prompts, responses, groups[i]) if i < len(groups)
                      else empty_micro_batch())
                values, entropy = self._forward(mb, temperature, with_entropy)
                for row, (idx, n) in enumerate(zip(mb.indices, mb.response_lens)):
                    out[idx] = values[row, :n].cpu()
                    if entropy is not None:
                        ent[idx] = entropy[row, :n].cpu()
        finally:
            self.model.train(was_training)
        missing = [i for i, t in enumerate(out) if t is None]
        if missing:
            raise RuntimeError(f"_infer: rows {missing[:5]} of {len(out)} were in no micro-batch of the plan")
        return [t for t in out if t is not None], ([t for t in ent if t is not None] if with_entropy else None)

    def compute_log_probs(self, prompts: list[Tensor], responses: list[Tensor], *,
                          temperature: float = 1.0, with_entropy: bool = False,
                          adapters: bool = True) -> tuple[list[Tensor], list[Tensor] | None]:
        """Collective with FSDP: every rank of the group calls it (possibly with no data).
        ``adapters=False`` (LoRA only): the base model's, the adapters off (the reference)."""
        if self.value_head:
            raise TypeError("compute_log_probs on a critic engine (value_head=True): use compute_values")
        if adapters:
            return self._infer(prompts, responses, temperature, with_entropy)
        if self.lora is None:
            raise TypeError("compute_log_probs(adapters=False) needs a LoRA engine (lora=LoraOptions(...))")
        disable_adapter = getattr(self.model, "disable_adapter", None)  # PEFT's wrapper has it
        if disable_adapter is None:
            raise TypeError(f"compute_log_probs(adapters=False): the model ({type(self.model).__name__}) is not "
                            "PEFT-wrapped")
        with disable_adapter():
            return self._infer(prompts, responses, temperature, with_entropy)

    def fold_adapters(self) -> int:
        """LoRA: merge the adapters into the base and zero them (lora.fold_adapters): the policy
        is unchanged, and the base, so the reference, is now it (RL after a supervised warm-up).
        The next weight sync sends the base too. Collective with FSDP."""
        if self.lora is None:
            raise TypeError("fold_adapters needs a LoRA engine")
        self._weights_change()
        self.base_changed = True
        return fold_adapters(self.model, self.lora.scale)

    def compute_values(self, prompts: list[Tensor], responses: list[Tensor]) -> list[Tensor]:
        """Value of the state before each response token (the position whose logits
        would predict it). Collective with FSDP."""
        if not self.value_head:
            raise TypeError("compute_values needs a critic engine: FSDPEngine(..., value_head=True)")
        return self._infer(prompts, responses, 1.0, False)[0]

    # ---------------------------------------------------------------- training
    @staticmethod
    def _check_fields(fields: dict[str, list[Tensor] | Tensor], responses: list[Tensor]) -> None:
        n = len(responses)
        for key, value in fields.items():
            if isinstance(value, Tensor):
                if value.dim() == 0 or value.shape[0] != n:
                    raise ValueError(f"field {key!r}: per-sequence tensor must have shape [{n}, ...], "
                                     f"got {tuple(value.shape)}")
                continue
            if len(value) != n:
                raise ValueError(f"field {key!r}: {len(value)} entries for {n} sequences")
            for i, (v, r) in enumerate(zip(value, responses)):
                if not isinstance(v, Tensor) or v.shape != r.shape:
                    raise ValueError(f"field {key!r}, sequence {i}: per-token tensor must have shape "
                                     f"{tuple(r.shape)} like its response, got "
                                     f"{tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}")

    def train_step(self, prompts: list[Tensor], responses: list[Tensor],
                   fields: dict[str, list[Tensor] | Tensor], loss_fn: LossFn, *,
                   temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        """Collective with FSDP: every rank calls it with its share (possibly empty)."""
        check_batch(prompts, responses)
        self._check_fields(fields, responses)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        with_entropy = with_entropy and not self.value_head
        loss_masks = response_loss_masks(fields, responses)  # None: every response token is trained on
        trained = ([int(m.sum()) for m in loss_masks] if loss_masks is not None
                   else [r.numel() for r in responses])
        num_tokens, num_seqs = self._all_reduce(
            [float(sum(trained)), float(sum(1 for n in trained if n > 0))], dist.ReduceOp.SUM)
        norm = LossNorm(num_tokens=num_tokens, num_seqs=num_seqs)
        groups, count = self._plan(prompts, responses)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, float] = {}
        n_metric = 0  # micro-batches with at least one model token: only they report metrics
        for i in range(count):
            if i < len(groups):
                mb = self._micro_batch(prompts, responses, groups[i], loss_masks=loss_masks)
                values, entropy = self._forward(mb, temperature, with_entropy)
                mb_fields = slice_fields(fields, mb, self.device)
                loss, metrics = loss_fn(values, entropy, mb.mask.to(self.device), mb_fields, norm)
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise TypeError(f"rank {self.rank}: loss_fn must return a scalar Tensor, got "
                                    f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
                if bool(mb.mask.any()):  # mb.mask is still on the host: no device sync
                    n_metric += 1
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
            else:  # placeholder: keeps FSDP's collectives in step with the other ranks
                values, _ = self._forward(empty_micro_batch(), temperature, False)
                loss = values.sum() * 0.0
            (loss * self.world_size).backward()
            loss_sum += loss.detach().double()

        grad_norm = self._clip_grad_norm()  # the global norm: the same on every rank
        loss_total = self._all_reduce([loss_sum.item()], dist.ReduceOp.SUM)[0]
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss_total))
        if skipped:  # every rank sees the same global values, so all skip together
            self._skip_nonfinite(loss_total, grad_norm)
        else:
            self._weights_change()
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.nonfinite_in_row = 0
            if self.trains_base:
                self.base_changed = True

        out = {"loss": loss_total, "grad_norm": grad_norm, "lr": float(lr),
               "n_micro_batches": float(count), "tokens": num_tokens, "skipped_nonfinite": float(skipped)}
        out.update(self._average_metrics(metric_sums, n_metric))
        return out

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        """Leave weights, optimizer moments and the LR schedule as they were; stop after too many."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_row += 1
        limit = self.optim_config.max_nonfinite_in_row
        what = f"loss {loss}, grad norm {grad_norm}"
        if self.nonfinite_in_row >= limit:
            raise NonFiniteUpdateError(
                f"rank {self.rank}: {self.nonfinite_in_row} updates in a row had a non-finite loss or gradient "
                f"norm (last: {what}); training diverged. Lower the learning rate, check rewards and data for "
                f"NaN/inf, or raise optim.max_nonfinite_in_row (now {limit}) to tolerate more")
        log.warning("rank %d: update skipped (%d in a row of at most %d): %s", self.rank, self.nonfinite_in_row,
                    limit, what)

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optim_config.grad_clip if self.optim_config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # DTensor with FSDP
            norm = norm.full_tensor()
        return float(norm)

    def _average_metrics(self, sums: dict[str, float], n_real: int) -> dict[str, float]:
        """loss_fn metrics averaged over the micro-batches of all ranks that hold a model token
        (``n_real`` of them on this rank)."""
        if self.process_group is None:
            return {k: v / n_real for k, v in sums.items()} if n_real else {}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (sums, n_real), group=self.process_group)
        total: dict[str, float] = {}
        count: dict[str, int] = {}
        for rank_sums, rank_n in gathered:
            for key, value in rank_sums.items():
                total[key] = total.get(key, 0.0) + value
                count[key] = count.get(key, 0) + rank_n
        return {k: total[k] / count[k] for k in sorted(total)}

    # ---------------------------------------------------------------- colocation
    def offload(self) -> int:
        """Another role is about to use this device. The last step's gradients go first (every
        train_step starts from none: zero_grad(set_to_none=True)), which frees memory on the CPU
        too; on an accelerator the parameters and optimizer state then move to host memory and
        the freed blocks go back to the device. On the CPU there is nothing to move."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cpu" or self.options.cpu_offload:  # (with cpu_offload FSDP2 keeps it on the host)
            return 0
        self._weights_change()
        moved = move_train_state(self.model, self.optimizer, torch.device("cpu"))
        getattr(torch, self.device.type).empty_cache()
        return moved

    def onload(self) -> int:
        """Parameters and optimizer state back onto the device (nothing to do on the CPU, or
        with cpu_offload: FSDP2 moves each layer's shards in for its compute)."""
        if self.device.type == "cpu" or self.options.cpu_offload:
            return 0
        return move_train_state(self.model, self.optimizer, self.device)

    # ---------------------------------------------------------------- weights & checkpoints
    def full_state_dict(self) -> dict[str, Tensor]:
        """Full fp32/param-dtype weights on CPU under the HF names, on RANK 0 ONLY (the other
        ranks of the group get {}). Collective with FSDP. For a critic the names are
        ValueModel's ('backbone.*', 'value_head.*')."""
        # torch.distributed.checkpoint is slow to import: only a weight sync or an export pays for it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.process_group is None:  # one rank, nothing to gather: a detached CPU copy
            # (not cpu_offload=True: that keeps the tensors on GLOBAL rank 0 only, and this rank
            # may be another, e.g. an actor placed on rank 1)
            return {k: v.detach().to("cpu", copy=True) for k, v in _tensors(get_model_state_dict(self.model)).items()}
        if dist.get_global_rank(self.process_group, 0) == 0:
            return _tensors(get_model_state_dict(self.model,
                                                 options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        # The group does not hold global rank 0, which is where cpu_offload puts the tensors:
        # gather on every rank of the group, keep a CPU copy on its first rank.
        state = _tensors(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True)))
        if dist.get_rank(self.process_group) != 0:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Collective; see checkpoint.py for the layout and the atomic write."""
        ckpt.save_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             step=self.step, extra=extra, process_group=self.process_group,
                             platform=self.platform)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self._weights_change()
        self.base_changed = True
        self.step, extra = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                                scheduler=self.scheduler,
                                                process_group=self.process_group, platform=self.platform)
        return extra

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> None:
        """Collective; rank 0 writes config + model.safetensors (+ tokenizer) into a temp
        dir and renames it to `path` (which must not exist yet). With LoRA the model written
        is the merged one (base + adapters), and the adapters alone go to a PEFT adapter
        directory beside it, ``<path>_adapter`` (``adapter_path``)."""
        if self.value_head:
            raise TypeError("export_hf writes a causal LM; this is a critic engine (value_head=True): "
                            "use full_state_dict() or save_checkpoint()")
        target = Path(path).absolute()
        state = self.full_state_dict()
        error = None
        if self.rank == 0:
            tmp = target.parent / f".{target.name}.tmp"
            try:
                if target.exists():
                    raise FileExistsError(f"{target} exists")
                if tmp.exists():
                    shutil.rmtree(tmp)
                with torch.device("meta"):
                    # the class of the model the source built: a transformers PreTrainedModel
                    model = cast("PreTrainedModel", self.hf_class(self.hf_config))
                if self.lora is not None:
                    adapter = adapter_path(target)
                    if adapter.exists():
                        raise FileExistsError(f"{adapter} exists")
                    save_adapter(target.parent / f".{adapter.name}.tmp", state, self.lora,
                                 getattr(self.hf_config, "_name_or_path", "") or "")
                    state = merge_state_dict(state, self.lora.scale)
                model.load_state_dict(state, strict=True, assign=True)
                model.tie_weights()
                model.save_pretrained(tmp, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                record_attn_implementation(tmp, getattr(self.hf_config, "_attn_implementation", None))
                os.rename(tmp, target)
                if self.lora is not None:
                    os.rename(target.parent / f".{adapter_path(target).name}.tmp", adapter_path(target))
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(target.parent / f".{adapter_path(target).name}.tmp", ignore_errors=True)
                error = f"{type(exc).__name__}: {exc}"
        errors = ckpt.gather_errors(error, self.process_group)
        if errors:
            raise RuntimeError(f"export_hf({target}) failed: " + "; ".join(errors))

