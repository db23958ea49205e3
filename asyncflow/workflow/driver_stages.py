"""Driver-side stage functions the built-in recipes use: plain functions of a ``DriverBatch``
that return new columns (or, for a filter, which rows to keep). A recipe of your own writes
its own the same way and names it in ``Stage(..., role="driver", fn=...)``.

Each is built from its settings (``advantages(cfg.algorithm)``) so that the stage reads as
one line in a recipe; the function itself is pure tensor math over the batch.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, overload

import torch

from .. import column_names as col
from ..algorithms import ADVANTAGES
from ..algorithms.advantages import outcome_to_token_rewards
from ..algorithms.kl import kl_penalty_to_reward
from ..transfer_queue.columns import JaggedColumn
from .stages import DriverBatch

__all__ = ["JaggedRows", "advantages", "equal_score_filter", "jagged_rows", "overlong_shaping", "pad_rows",
           "unpad_rows"]


class JaggedRows(JaggedColumn):
    """Rows of different lengths as one flat tensor and offsets, read as a sequence of 1-D
    tensors (``rows[i]``, iteration, ``len``); the TransferQueue stores it as it is (one
    column, no per-row copies)."""

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self.row(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self.row(i % len(self))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.split(self.values, self.lengths().tolist()))


def jagged_rows(x: torch.Tensor, mask: torch.Tensor) -> JaggedRows:
    """``unpad_rows`` as one column: the entries of ``x`` [B, T] where ``mask`` is true, row by
    row, as float32 (each row's mask a prefix: its length)."""
    offsets = torch.zeros(x.shape[0] + 1, dtype=torch.long)
    torch.cumsum(mask.sum(1), 0, out=offsets[1:])
    return JaggedRows(x[mask].float().contiguous(), offsets)


def pad_rows(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D float tensors to [B, T]; returns (padded, mask)."""
    n = max((len(s) for s in seqs), default=0)
    out = torch.zeros(len(seqs), max(n, 1), dtype=torch.float32)
    mask = torch.zeros(len(seqs), max(n, 1), dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s.float()
        mask[i, :len(s)] = True
    return out, mask


def unpad_rows(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [x[i][mask[i]].float().contiguous() for i in range(x.shape[0])]


def advantages(algo: Any, score: str = col.SCORES, response: str = col.RESPONSE_IDS,
               loss_mask: str = col.LOSS_MASK) -> Callable[[DriverBatch], dict[str, Any]]:
    """The step's per-token advantages and returns, once, from outcome scores (with critic
    ``values`` for GAE, and the KL to a reference folded into the reward with
    ``algo.kl_in_reward``). Group estimators need whole groups in the batch (a group sampler).

    Multi-turn rows: when the batch has a ``loss_mask`` column (one 0/1 or bool tensor per
    row, the response's length; 1 = model token, 0 = tool / environment token), the
    estimator's token mask is that column: the outcome reward sits on the last MODEL token,
    the KL penalty, returns and GAE recursions skip tool tokens (no reward, no discount step,
    as if they were cut out), whitening counts model tokens only, and the advantages and
    returns written are 0 on tool tokens. Rows keep their response length. A row without any
    model token gets no reward (the group estimators then take its score as 0)."""
    ADVANTAGES.get(algo.advantage)  # an unknown estimator fails here, when the recipe is built
    # a partial of a module-level function: the built recipe pickles (the launcher hands it on)
    return functools.partial(_advantages, algo, score, response, loss_mask)


def _advantages(algo: Any, score: str, response: str, loss_mask: str, batch: DriverBatch) -> dict[str, Any]:
    estimator = ADVANTAGES.get(algo.advantage)
    lengths = [len(r) for r in batch[response]]
    width = max(lengths, default=1) or 1
    rows_mask = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    mask = (_model_tokens(batch[loss_mask], lengths, rows_mask.shape[1], loss_mask)
            if loss_mask in batch.columns else rows_mask)
    token_rewards = outcome_to_token_rewards(batch[score].float(), mask)
    if algo.kl_in_reward and algo.kl_coef > 0:
        proximal = batch.columns.get(col.OLD_LOG_PROBS, batch.columns.get(col.BEHAV_LOG_PROBS))
        if proximal is None or col.REF_LOG_PROBS not in batch.columns:
            raise ValueError("algorithm.kl_in_reward: the advantage stage must read ref_log_probs and "
                             "old_log_probs (or behav_log_probs)")
        token_rewards = kl_penalty_to_reward(token_rewards, _fit(pad_rows(proximal)[0], mask),
                                             _fit(pad_rows(batch[col.REF_LOG_PROBS])[0], mask), mask,
                                             algo.kl_coef, algo.kl_estimator)
    values = _fit(pad_rows(batch[col.VALUES])[0], mask) if col.VALUES in batch.columns else None
    groups = torch.tensor(batch.groups, dtype=torch.long)
    adv, ret = estimator(token_rewards, mask, group_ids=groups, values=values, cfg=algo)
    # 0 on tool tokens whatever the estimator (a recipe's own may not promise it); full-length rows
    adv, ret = adv.masked_fill(~mask, 0.0), ret.masked_fill(~mask, 0.0)
    return {col.ADVANTAGES: jagged_rows(adv, rows_mask), col.RETURNS: jagged_rows(ret, rows_mask)}


def _model_tokens(column: Any, lengths: list[int], width: int, name: str) -> torch.Tensor:
    """The ``loss_mask`` column as a bool [B, width] mask (True = model token), after checking
    that each row is the response's length and holds only 0 and 1."""
    if len(column) != len(lengths):
        raise ValueError(f"column {name!r}: {len(column)} rows for {len(lengths)} responses")
    out = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, (m, n) in enumerate(zip(column, lengths)):
        m = torch.as_tensor(m).reshape(-1)
        if m.numel() != n:
            raise ValueError(f"column {name!r}, row {i}: {m.numel()} entries for a response of {n} tokens")
        if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
            raise ValueError(f"column {name!r}, row {i}: must hold only 0 and 1 (1 = model token), "
                             f"got the values {torch.unique(m)[:8].tolist()}")
        out[i, :n] = m != 0
    return out


def _fit(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` padded to ``mask``'s width (rows of length 0 pad to one column)."""
    if x.shape[1] == mask.shape[1]:
        return x
    out = torch.zeros(mask.shape, dtype=x.dtype)
    w = min(x.shape[1], mask.shape[1])
    out[:, :w] = x[:, :w]
    return out


def equal_score_filter(score: str = col.SCORES) -> Callable[[DriverBatch], torch.Tensor]:
    """Dynamic sampling (DAPO): keep the groups whose scores are not all equal (a group of
    equal rewards has zero advantage everywhere: no learning signal)."""
    return functools.partial(_unequal_groups, score)


def _unequal_groups(score: str, batch: DriverBatch) -> torch.Tensor:
    scores = batch[score].tolist()
    spread: dict[int, tuple[float, float]] = {}
    for g, s in zip(batch.groups, scores):
        lo, hi = spread.get(g, (s, s))
        spread[g] = (min(lo, s), max(hi, s))
    return torch.tensor([spread[g][1] > spread[g][0] for g in batch.groups], dtype=torch.bool)


def overlong_shaping(max_new_tokens: int, buffer: int, penalty: float, score: str = col.SCORES,
                     response: str = col.RESPONSE_IDS) -> Callable[[DriverBatch], torch.Tensor]:
    """DAPO's soft overlong punishment: a response longer than ``max_new_tokens - buffer``
    loses ``penalty * excess / buffer`` of its score (at most ``penalty``, reached at the cap)."""
    if buffer < 1 or buffer > max_new_tokens:
        raise ValueError(f"overlong shaping: the buffer must be within 1..max_new_tokens ({max_new_tokens}), "
                         f"got {buffer} (reward.overlong_buffer)")
    return functools.partial(_overlong_shaped, max_new_tokens - buffer, buffer, penalty, score, response)


def _overlong_shaped(start: int, buffer: int, penalty: float, score: str, response: str,
                     batch: DriverBatch) -> torch.Tensor:
    lengths = torch.tensor([len(r) for r in batch[response]], dtype=torch.float32)
    excess = (lengths - start).clamp(min=0)
    scores: torch.Tensor = batch[score].float()
    return scores - penalty * (excess / buffer).clamp(max=1.0)
