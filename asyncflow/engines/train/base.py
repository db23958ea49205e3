"""The training-engine interface that the actor and critic workers call.

A `TrainEngine` owns one model (policy, or critic with a value head), its optimizer,
LR schedule and checkpoints. Each data-parallel rank holds one engine and passes its
own share of the global batch; the engine makes the ranks agree on everything that
must match (loss normalisation, number of micro-batches, gradients).

The engine knows nothing about RL algorithms: `train_step` receives a `LossFn`.

Multi-turn rows (model tokens interleaved with tool / environment tokens in one response):
the optional per-token field ``"loss_mask"`` of `train_step` (``LOSS_MASK``) says which response
tokens are the model's own. Contract: one 1-D tensor per sequence, the response's length, dtype
bool or any integer/float dtype holding only 0 and 1 (anything else raises ValueError);
1 = a model token (trained on), 0 = a tool / environment token (no gradient, and it counts in no
loss normalisation and no metric). Without the field every response token is a model token.
The engine then
* hands ``loss_fn`` ``mask`` = real response token AND loss_mask, and zero-fills the log-probs
  (values for a critic), the entropy and every per-token field outside that mask, so a masked
  token looks exactly like padding (its log-prob gets no gradient even if a loss forgets the
  mask, and garbage such as NaN in a field there cannot leak into the loss);
* counts ``LossNorm.num_tokens`` = model tokens and ``LossNorm.num_seqs`` = sequences with at
  least one model token (a row without any adds nothing to a loss sum, so it must not dilute a
  per-sequence mean either: the definition of ``algorithms.aggregate.count_seqs``), both summed
  over the data-parallel ranks; the ``tokens`` metric is that num_tokens;
* averages loss_fn's metrics over the micro-batches that hold at least one model token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ...config import OptimConfig  # the config tree's section is what the engines take

__all__ = ["LOSS_MASK", "LossFn", "LossNorm", "NonFiniteUpdateError", "OptimConfig", "TrainEngine", "move_train_state"]


LOSS_MASK = "loss_mask"  # the optional per-token train_step field: 1 = model token (see the module docstring)


class NonFiniteUpdateError(FloatingPointError):
    """Too many updates in a row had a NaN/inf loss or gradient norm: training diverged."""


@dataclass
class LossNorm:
    """Global counts over the WHOLE global batch, summed over all data-parallel ranks."""

    num_tokens: float  # model tokens: response tokens where loss_mask (if given) is 1
    num_seqs: float  # sequences with at least one such token


class LossFn(Protocol):
    """loss_fn(log_probs, entropy, mask, fields, norm) -> (loss, metrics).

    log_probs: [b, T] float32, log-prob of each response token (right-padded; for a
        critic engine this argument holds the predicted values instead).
    entropy: [b, T] float32 or None (when with_entropy is False, and for critics).
    mask: [b, T] bool, True on real response tokens that are model tokens (the
        "loss_mask" field AND not padding). log_probs, entropy and every per-token field
        are 0 where mask is False.
    fields: each per-token input given to train_step, right-padded to [b, T]; each
        per-sequence input as [b].
    norm: global counts; the returned loss must already be normalised by them, so
        that summing it over micro-batches and ranks gives the full-batch loss.
    """

    def __call__(
        self,
        log_probs: Tensor,
        entropy: Tensor | None,
        mask: Tensor,
        fields: dict[str, Tensor],
        norm: LossNorm,
    ) -> tuple[Tensor, dict[str, float]]: ...


class TrainEngine(ABC):
    """One model + optimizer on one data-parallel rank. See module docstring."""

    step: int  # optimizer steps taken
    # An engine that calls ``before_weights_change`` (when set) before anything writes its
    # parameters' memory (optimizer step, loading weights, offload) sets this True: a weight
    # sync may then leave messages that read that memory on the wire past its return.
    guards_weight_writes: bool = False
    before_weights_change: Callable[[], None] | None = None

    @abstractmethod
    def reset_optimizer(self, optim: OptimConfig) -> None:
        """A fresh optimizer and schedule on the current weights."""

    @abstractmethod
    def load_model_state(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the weights with a full, HF-named state dict."""

    @abstractmethod
    def compute_log_probs(
        self,
        prompts: list[Tensor],
        responses: list[Tensor],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Log-prob of each response token under softmax(logits / temperature).

        One 1-D float32 tensor per sequence (length = response length), in input
        order; entropies the same way when with_entropy, else None.
        """

    @abstractmethod
    def compute_values(self, prompts: list[Tensor], responses: list[Tensor]) -> list[Tensor]:
        """Critic engines only: the value of each response token's state, one 1-D
        float32 tensor per sequence (length = response length)."""

    @abstractmethod
    def train_step(
        self,
        prompts: list[Tensor],
        responses: list[Tensor],
        fields: dict[str, list[Tensor] | Tensor],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over this rank's share of the global batch.

        fields: per-token inputs (a list of 1-D tensors shaped like the responses) and
        per-sequence ones (a tensor [n, ...]); the per-token "loss_mask" restricts training
        to model tokens (module docstring).
        Returns metrics identical on every rank: loss (full global-batch loss),
        grad_norm (before clipping), lr (used for this step), n_micro_batches, tokens
        (global model tokens = LossNorm.num_tokens) and loss_fn's metrics averaged over the
        micro-batches holding at least one model token.
        """

    @abstractmethod
    def full_state_dict(self) -> dict[str, Tensor]:
        """Full, unsharded weights in host memory under the HF model's own names."""

    @abstractmethod
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Atomically save model, optimizer, scheduler, step, per-rank RNG and extra."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore everything save_checkpoint wrote; returns extra."""

    @abstractmethod
    def export_hf(self, path: str | Path, tokenizer: Any = None) -> None:
        """Write a directory that AutoModelForCausalLM.from_pretrained loads."""

    # Colocated roles take turns on a device: the idle one frees what it can. An engine with
    # nothing to free keeps these defaults.
    def offload(self) -> int:
        """Free device memory while another role runs; returns the bytes moved to host."""
        return 0

    def onload(self) -> int:
        """Undo offload before the next call; returns the bytes moved back to the device."""
        return 0


def check_batch(prompts: list[Tensor], responses: list[Tensor]) -> None:
    """Raise ValueError (naming the sequence) unless prompts/responses are 1-D int tensors."""
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for name, t in (("prompt", p), ("response", r)):
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise ValueError(f"{name} {i} must be a 1-D tensor, got {type(t).__name__} "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else ''}")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{name} {i} must hold integer token ids, got {t.dtype}")
        if p.numel() == 0:
            raise ValueError(f"prompt {i} is empty: the first response token needs a preceding token")


def response_loss_masks(fields: dict[str, list[Tensor] | Tensor],
                        responses: list[Tensor]) -> list[Tensor] | None:
    """The ``"loss_mask"`` field as one bool tensor per sequence (True = model token), or None
    when there is none. Raises ValueError unless it is per-token, shaped like the responses,
    and holds only 0/1 (bool, integer or float)."""
    value = fields.get(LOSS_MASK)
    if value is None:
        return None
    if isinstance(value, Tensor):
        raise ValueError(f"field {LOSS_MASK!r} must be per-token (one 1-D tensor per sequence, "
                         f"the response's length), got a per-sequence tensor {tuple(value.shape)}")
    if len(value) != len(responses):
        raise ValueError(f"field {LOSS_MASK!r}: {len(value)} entries for {len(responses)} sequences")
    out = []
    for i, (m, r) in enumerate(zip(value, responses)):
        if not isinstance(m, Tensor) or m.shape != r.shape:
            raise ValueError(f"field {LOSS_MASK!r}, sequence {i}: per-token tensor must have shape "
                             f"{tuple(r.shape)} like its response, got "
                             f"{tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__}")
        if m.dtype != torch.bool:
            if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(f"field {LOSS_MASK!r}, sequence {i}: must hold only 0 and 1 "
                                 f"(1 = model token), got the values {torch.unique(m)[:8].tolist()}")
            m = m != 0
        out.append(m.detach().to("cpu"))
    return out


def _on(t: Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (a device without an index matches any of its type)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _local_nbytes(t: Tensor) -> int:
    """Bytes this rank holds for ``t``: a DTensor's local shard, else the tensor itself."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def move_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     device: torch.device | str) -> int:
    """Move a module's parameters, gradients and buffers and the optimizer's state tensors to
    ``device``; return the bytes moved (per rank: DTensors count their local shard).

    The module moves with ``module.to``: with FSDP2 that is the supported route, since
    ``FSDPModule._apply`` reshards first and re-points FSDP's sharded parameters at the moved
    local tensors afterwards (per-parameter ``.data`` moves would leave FSDP reading the old
    storage). It runs with torch's swap-on-conversion semantics, which keep every Parameter
    object (its contents are swapped): by default torch keeps them only where it can assign
    ``.data`` (cpu <-> cuda) and elsewhere (another device type such as an out-of-tree
    accelerator, or 'meta') makes new ones, which would untie tied weights and leave the
    optimizer stepping the old tensors. Scalar optimizer state (Adam's ``step``) stays where
    it is: bookkeeping, not memory (the fused kernel keeps it beside the parameters, the
    per-tensor one on the host), and nothing steps while the state is away. When
    nothing is elsewhere this costs one pass over the tensors and no ``.to``.
    """
    device = torch.device(device)
    params = list(module.parameters())
    held = [*params, *(p.grad for p in params if p.grad is not None), *module.buffers()]
    moved = sum(_local_nbytes(t) for t in held if not _on(t, device))
    if moved:
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            module.to(device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        if any(a is not b for a, b in zip(params, module.parameters())):  # swap semantics promise this
            raise RuntimeError(f"move_train_state: moving {type(module).__name__} to {device} replaced "
                               "parameter objects; the optimizer would no longer update the model")
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0 and not _on(value, device):
                    moved += _local_nbytes(value)
                    state[key] = value.to(device)
    return moved
