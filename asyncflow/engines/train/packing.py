"""Padding-free micro-batches: the sequences of a micro-batch packed end to end.

Layout of one packed micro-batch of b sequences, N = their total length, R = the longest
response: ``input_ids`` [1, N]; ``position_ids`` [1, N] restarting at 0 with each sequence;
no attention mask; ``cu_seqlens`` [b + 1] the sequences' start offsets (int32) and
``max_seqlen`` the longest. The response token j of sequence i (starting at offset o_i, prompt
length p_i) is predicted by the logits at o_i + p_i + j - 1 (``logit_pos`` [b, R], in row
``rows[i]``); ``targets``/``mask`` as in microbatch.py.

For the eager and SDPA kernels the sequences are spread over rows of at most
max(``ROW_TOKENS``, longest) tokens instead (``row_packing.pack_rows``; [rows, W], each row's
tail padding a sequence of its own, no ``cu_seqlens``): those kernels score a row's whole
block, so one long row would cost N x N.

Attention must not cross sequences. Hugging Face models see it from the position ids: with no
attention mask and no cache, ``transformers.masking_utils`` finds where positions restart
(``find_packed_sequence_indices``) and builds a block-diagonal causal mask for the eager and
SDPA kernels (the CPU path, tested against the padded path); flash-attention kernels take the
cumulative lengths instead (``cu_seq_lens_*`` / ``max_length_*`` keyword arguments, which the
engine passes for those kernels; not run here: no accelerator).

Cost: the eager and SDPA kernels score each packed row's W x W block (masked), where the
padded path scores b x L x L; flash kernels score only the blocks on the diagonal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncflow.engines.row_packing import pack_rows
from asyncflow.engines.train.microbatch import MicroBatch, joined_sequences, pad_right

__all__ = ["ROW_TOKENS", "build_packed_micro_batch", "check_packing_supported", "flash_kwargs",
           "plan_packed_micro_batches"]

# Packed rows for the eager and SDPA kernels hold about this many tokens: they score a row's
# whole N x N block, so one row per micro-batch would cost attention quadratic in the batch.
ROW_TOKENS = 64


def check_packing_supported() -> None:
    """Raise with the fix unless transformers builds packed-sequence masks from position ids."""
    try:
        from transformers import masking_utils
    except ImportError as exc:
        raise ValueError(f"model.padding_free needs transformers.masking_utils ({exc}); install "
                         "transformers>=4.56 or set model.padding_free=false") from exc
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        raise ValueError("model.padding_free: this transformers does not detect packed sequences from position ids "
                         "(masking_utils.find_packed_sequence_indices), so attention would cross sequences; "
                         "upgrade transformers or set model.padding_free=false")


def plan_packed_micro_batches(lengths: list[int], token_budget: int, row_tokens: int = 0) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``token_budget`` tokens in total
    (a longer sequence gets one of its own): first fit, longest first, so few micro-batches.
    Deterministic (ties keep input order); within a group, longest first.

    ``row_tokens`` > 0 (the eager and SDPA layout of ``build_packed_micro_batch``): the rows a
    group packs into are padded to a common width, so a group whose rows hold more than
    ``token_budget`` positions, padding included, is split (its longest sequences first): the
    budget bounds the tensors a micro-batch makes, as it does on the padded path."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    free: list[int] = []
    for i in order:
        slot = next((g for g, room in enumerate(free) if lengths[i] <= room), None)
        if slot is None:
            groups.append([i])
            free.append(token_budget - lengths[i])
        else:
            groups[slot].append(i)
            free[slot] -= lengths[i]
    if row_tokens <= 0:
        return groups
    return [part for g in groups for part in _split_to_padded_budget(g, lengths, token_budget, row_tokens)]


def packed_positions(lengths: list[int], row_tokens: int) -> int:
    """Positions, padding included, of the rows ``build_packed_micro_batch`` packs these into."""
    rows = pack_rows(lengths, row_tokens)
    return len(rows) * max(sum(lengths[i] for i in r) for r in rows) if rows else 0


def _split_to_padded_budget(group: list[int], lengths: list[int], budget: int, row_tokens: int) -> list[list[int]]:
    """``group`` (longest first) cut into runs whose packed rows fit ``budget`` positions: each
    run is the longest prefix of what is left that fits (found by bisection; one sequence
    always makes a run)."""
    out: list[list[int]] = []
    rest = group
    while rest:
        if packed_positions([lengths[i] for i in rest], row_tokens) <= budget:
            out.append(rest)
            break
        lo, hi = 1, len(rest) - 1  # the whole of rest does not fit; a prefix of lo always may
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if packed_positions([lengths[i] for i in rest[:mid]], row_tokens) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append(rest[:lo])
        rest = rest[lo:]
    return out


def build_packed_micro_batch(prompts: list[Tensor], responses: list[Tensor], indices: list[int],
                             loss_masks: list[Tensor] | None = None, row_tokens: int = 0) -> MicroBatch:
    """Pack the sequences ``indices`` (prompt then response each) end to end; see the module
    docstring. ``row_tokens`` > 0 spreads them over rows of at most max(row_tokens, longest)
    tokens (eager and SDPA score a row's whole block, so shorter rows cost less attention);
    the shorter rows end in padding that is a sequence of its own (positions from 0), never
    attended to from the real ones. ``loss_masks`` as in microbatch.build_micro_batch."""
    seqs, plens, rlens = joined_sequences(prompts, responses, indices)
    lens = [s.numel() for s in seqs]
    layout = pack_rows(lens, row_tokens)
    width = max(sum(lens[i] for i in members) for members in layout)
    input_ids = torch.zeros((len(layout), width), dtype=torch.long)
    position_ids = torch.zeros((len(layout), width), dtype=torch.long)
    row_of = torch.zeros(len(seqs), dtype=torch.long)
    starts = torch.zeros(len(seqs), dtype=torch.long)
    for r, members in enumerate(layout):
        off = 0
        for i in members:
            input_ids[r, off:off + lens[i]] = seqs[i]
            position_ids[r, off:off + lens[i]] = torch.arange(lens[i])
            row_of[i], starts[i] = r, off
            off += lens[i]
        position_ids[r, off:] = torch.arange(width - off)  # the padding: a sequence of its own
    rwidth = max(max(rlens), 1)
    rcols = torch.arange(rwidth)
    mask = rcols[None, :] < torch.tensor(rlens)[:, None]
    # Padded response slots point at the prompt's last position: valid, and masked out afterwards.
    logit_pos = starts[:, None] + torch.tensor(plens)[:, None] - 1 + rcols[None, :] * mask
    targets = input_ids[row_of[:, None], (logit_pos + 1).clamp(max=width - 1)] * mask
    if loss_masks is not None:
        mask = mask & pad_right([loss_masks[i].to("cpu", torch.bool) for i in indices], rwidth, False)
    one_row = len(layout) == 1
    cu_seqlens = (torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(torch.tensor(lens), 0).to(torch.int32)])
                  if one_row else None)
    return MicroBatch(list(indices), input_ids, None, position_ids, logit_pos, targets, mask, rlens,
                      packed=True, cu_seqlens=cu_seqlens, max_seqlen=max(lens), rows=row_of[:, None])


def flash_kwargs(mb: MicroBatch, attn_implementation: str | None) -> dict[str, object]:
    """The cumulative lengths flash-attention kernels take for a packed micro-batch (so that
    they need not derive them from the position ids); none for other kernels or layouts."""
    if not mb.packed or mb.cu_seqlens is None or "flash" not in (attn_implementation or ""):
        return {}
    return {"cu_seq_lens_q": mb.cu_seqlens, "cu_seq_lens_k": mb.cu_seqlens,
            "max_length_q": mb.max_seqlen, "max_length_k": mb.max_seqlen}
