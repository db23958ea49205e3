"""Token-budget micro-batching and right-padding of variable-length sequences.

Sequences are sorted by length (longest first) and cut into runs of neighbours, each
run one micro-batch whose padded size (rows x longest row) stays within the budget. With
``overhead_tokens`` the cut points minimise the padded tokens plus that fixed charge per
micro-batch: under long-tailed lengths one micro-batch padded to the longest row spends
most of its compute on padding, while one micro-batch per length pays the per-pass cost
many times. Without it, runs are filled greedily (the fewest micro-batches). A sequence
longer than the budget gets a micro-batch of its own.

Layout of one micro-batch of b sequences, L = longest prompt+response, R = longest
response: `input_ids` [b, L] right-padded; `position_ids` 0..len-1 per row; the
response token j of row i sits at input position p_i + j and is predicted by the
logits at position p_i + j - 1 (`logit_pos` [b, R]); `targets` [b, R] are the
response tokens (packing.py has the padding-free layout); `mask` [b, R] marks the real ones
that are trained on: with per-sequence ``loss_masks`` (multi-turn rows, see base.py) only the model tokens among them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

__all__ = ["MicroBatch", "build_micro_batch", "empty_micro_batch", "pad_right", "plan_micro_batches",
           "slice_fields"]


def plan_micro_batches(lengths: list[int], token_budget: int,
                       overhead_tokens: int | None = None) -> list[list[int]]:
    """Group sequence indices into micro-batches of padded size <= token_budget.

    Longest first; within a micro-batch the first index is the longest, so the padded
    size is len(group) * lengths[group[0]]. ``overhead_tokens`` (>= 0): choose the cuts
    that minimise sum(padded size) + overhead_tokens * micro-batches; None: fill greedily.
    Deterministic (ties keep input order).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if overhead_tokens is not None and overhead_tokens < 0:
        raise ValueError(f"overhead_tokens must be >= 0, got {overhead_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if overhead_tokens is not None:
        return [[order[k] for k in range(a, b)] for a, b in _cheapest_cuts([lengths[i] for i in order],
                                                                         token_budget, overhead_tokens)]
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _cheapest_cuts(desc: list[int], budget: int, overhead: int) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of the descending lengths ``desc`` minimising sum((b - a) * desc[a])
    + overhead per run, each run within the budget (or a single sequence). Dynamic
    programming over run ends, the candidate starts of each end scored at once."""
    n = len(desc)
    if n == 0:
        return []
    length = np.asarray(desc, dtype=np.float64)
    starts = np.arange(n, dtype=np.float64)
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        size = (end - starts[:end]) * length[:end]  # padded size of the run [a, end) for every a
        cost = best[:end] + size + overhead
        cost[size > budget] = np.inf
        cost[end - 1] = best[end - 1] + length[end - 1] + overhead  # one sequence always fits
        a = int(np.argmin(cost))
        best[end], cut[end] = cost[a], a
    runs, end = [], n
    while end > 0:
        runs.append((int(cut[end]), end))
        end = int(cut[end])
    return runs[::-1]


def pad_right(rows: list[Tensor], length: int, value: float | int | bool = 0) -> Tensor:
    """Stack 1-D tensors into [len(rows), length], right-padded with `value`."""
    if not rows:
        raise ValueError("pad_right needs at least one row")
    lens = [row.numel() for row in rows]
    over = next((i for i, n in enumerate(lens) if n > length), None)
    if over is not None:
        raise ValueError(f"row {over} has {lens[over]} elements, more than the padded length {length}")
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype, device=rows[0].device)
    lens_t = torch.tensor(lens, device=out.device)
    _write_rows(out, torch.cat(rows), torch.zeros_like(lens_t), lens_t)
    return out


def _write_rows(out: Tensor, values: Tensor, starts: Tensor, lens: Tensor) -> None:
    """Row i of ``out`` gets its ``lens[i]`` values from column ``starts[i]`` (``values``: every
    row's, end to end): one masked write for all rows, not one a row."""
    cols = torch.arange(out.shape[1], device=out.device)[None, :]
    out[(cols >= starts[:, None]) & (cols < (starts + lens)[:, None])] = values


@dataclass
class MicroBatch:
    indices: list[int]  # positions of these rows in the caller's lists
    input_ids: Tensor  # [b, L] long ([rows, W] when packed)
    attention_mask: Tensor | None  # [b, L] long, 1 on real tokens; None when packed
    position_ids: Tensor  # [b, L] long
    logit_pos: Tensor  # [b, R] long, position whose output predicts each response token
    targets: Tensor  # [b, R] long, the response tokens (0 on padding)
    mask: Tensor  # [b, R] bool, True on real response tokens (that the loss mask, if any, keeps)
    response_lens: list[int]
    packed: bool = False  # packing.py's layout: sequences end to end in rows, positions restart per sequence
    cu_seqlens: Tensor | None = None  # packed in one row: [b + 1] int32 start offsets of the sequences, then N
    max_seqlen: int = 0  # packed: the longest sequence
    rows: Tensor | None = None  # packed: [b, 1] long, the row that holds each sequence

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> MicroBatch:
        moved = replace(self)  # every tensor field moved, whatever fields the batch has
        for k, v in list(vars(moved).items()):
            if isinstance(v, Tensor):
                setattr(moved, k, v.to(device, non_blocking=True))
        return moved


def joined_sequences(prompts: list[Tensor], responses: list[Tensor],
                     indices: list[int]) -> tuple[list[Tensor], list[int], list[int]]:
    """The sequences ``indices`` as prompt + response (int64, host), with each one's prompt
    and response lengths."""
    if not indices:
        raise ValueError("a micro-batch needs at least one sequence")
    seqs, plens, rlens = [], [], []
    for i in indices:
        p, r = prompts[i].long().cpu(), responses[i].long().cpu()
        seqs.append(torch.cat([p, r]))
        plens.append(p.numel())
        rlens.append(r.numel())
    return seqs, plens, rlens


def build_micro_batch(prompts: list[Tensor], responses: list[Tensor], indices: list[int],
                      pad_id: int = 0, loss_masks: list[Tensor] | None = None) -> MicroBatch:
    """Right-pad the sequences `indices` (prompt then response) into one MicroBatch.

    loss_masks: one bool tensor per sequence (all of them, like ``prompts``), True on the
    response tokens to train on; ``mask`` is then the real response tokens AND it. The
    layout (input_ids, logit_pos, targets) does not depend on it."""
    if not indices:
        raise ValueError("a micro-batch needs at least one sequence")
    ps = [prompts[i].to("cpu", torch.long) for i in indices]
    rs = [responses[i].to("cpu", torch.long) for i in indices]
    plens, rlens = [p.numel() for p in ps], [r.numel() for r in rs]
    plen_t, rlen_t = torch.tensor(plens), torch.tensor(rlens)
    lens = plen_t + rlen_t
    width = int(lens.max())
    rwidth = max(max(rlens), 1)
    # prompts from column 0, each response right after its prompt: two writes for all rows
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    _write_rows(input_ids, torch.cat(ps), torch.zeros_like(plen_t), plen_t)
    _write_rows(input_ids, torch.cat(rs), plen_t, rlen_t)
    cols = torch.arange(width)
    attention_mask = (cols[None, :] < lens[:, None]).long()
    position_ids = cols[None, :].expand(len(indices), width) * attention_mask
    rcols = torch.arange(rwidth)
    mask = rcols[None, :] < rlen_t[:, None]
    # Padded response slots point at the prompt's last position: a valid index whose
    # value is masked out afterwards.
    logit_pos = plen_t[:, None] - 1 + rcols[None, :] * mask
    targets = torch.gather(input_ids, 1, (logit_pos + 1).clamp(max=width - 1)) * mask
    if loss_masks is not None:
        mask = mask & pad_right([loss_masks[i].to("cpu", torch.bool) for i in indices], rwidth, False)
    return MicroBatch(list(indices), input_ids, attention_mask, position_ids.contiguous(), logit_pos,
                      targets, mask, rlens)


def empty_micro_batch() -> MicroBatch:
    """A one-token placeholder for ranks that ran out of data: it runs forward and
    backward (so FSDP's collectives match the other ranks) and carries no tokens."""
    one = torch.zeros(1, 1, dtype=torch.long)
    return MicroBatch([], one, torch.ones_like(one), one.clone(), one.clone(), one.clone(),
                      torch.zeros(1, 1, dtype=torch.bool), [])


def slice_fields(fields: dict[str, list[Tensor] | Tensor], mb: MicroBatch,
                 device: torch.device) -> dict[str, Tensor]:
    """The loss inputs of one micro-batch: per-token lists padded to [b, R] and 0 wherever
    ``mb.mask`` is False (padding, and tokens the loss mask drops: a loss never sees their
    values), per-sequence tensors indexed to [b]."""
    width = mb.mask.shape[1]
    keep = mb.mask.to("cpu")
    out: dict[str, Tensor] = {}
    for key, value in fields.items():
        if isinstance(value, Tensor):
            out[key] = value[torch.tensor(mb.indices, dtype=torch.long, device=value.device)].to(device)
        else:
            padded = pad_right([value[i] for i in mb.indices], width)
            out[key] = padded.masked_fill(~keep.to(padded.device), 0).to(device)
    return out
