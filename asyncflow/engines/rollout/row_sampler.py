"""The built-in engine's sampler: one token per running row, whatever each row's sampling params.

Rows that share their params are sampled together as a few whole-batch tensor ops
(``sampling.sample_step``) with per-row counter-based noise, so a row's tokens depend on its
own seed and token index only, never on which rows share the batch. It also says which
sampled tokens stop their row (eos unless ignored, plus the request's stop tokens).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncflow.engines.rollout.base import SamplingParams
from asyncflow.engines.rollout.sampling import SeedKeys, sample_step, vocab_hash

__all__ = ["RowSampler"]

_ParamsKey = tuple[float, int, float, tuple[int, ...], bool]


def _params_key(p: SamplingParams) -> _ParamsKey:
    return (p.temperature, p.top_k, p.top_p, p.stop_token_ids, p.ignore_eos)


class RowSampler:
    """Samples the next token of every row from its logits; holds the per-vocab tables it reuses."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._vhash = vocab_hash(vocab_size, device)
        self._stop_masks: dict[tuple[tuple[int, ...], bool], torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], key_a: torch.Tensor,
               key_b: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row j's token, its log-prob and whether it stops the row, sampled with params[j] from
        logits[j] (key_a/key_b: the row's seed keys; steps: its token index)."""
        n = len(params)
        groups: dict[_ParamsKey, list[int]] = {}
        for j, p in enumerate(params):
            groups.setdefault(_params_key(p), []).append(j)
        if len(groups) == 1:
            tok, lp = self._sample_rows(logits, params[0], key_a, key_b, steps)
            return tok, lp, self._stop_mask(params[0])[tok]
        tok = torch.empty(n, dtype=torch.int64, device=self.device)
        lp = torch.empty(n, dtype=torch.float32, device=self.device)
        stopped = torch.empty(n, dtype=torch.bool, device=self.device)
        for rows in groups.values():
            idx = torch.tensor(rows, device=self.device)
            first = params[rows[0]]
            t, t_lp = self._sample_rows(logits[idx], first, key_a[idx], key_b[idx], steps[idx])
            tok[idx], lp[idx], stopped[idx] = t, t_lp, self._stop_mask(first)[t]
        return tok, lp, stopped

    def set_eos(self, eos_token_ids: tuple[int, ...]) -> None:
        """Stop rows on these ids from now on."""
        self.eos_token_ids = eos_token_ids
        self._stop_masks.clear()

    def to(self, device: torch.device | str) -> None:
        """Move the sampler's tables (released memory goes to the host, resumed memory back)."""
        self._vhash = self._vhash.to(device)

    def _sample_rows(self, logits: torch.Tensor, params: SamplingParams, key_a: torch.Tensor, key_b: torch.Tensor,
                     steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = None if params.greedy else SeedKeys.of(key_a, key_b)
        return sample_step(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           keys=keys, step=steps, vhash=self._vhash)

    def _stop_mask(self, params: SamplingParams) -> torch.Tensor:
        key = (params.stop_token_ids, params.ignore_eos)
        m = self._stop_masks.get(key)
        if m is None:
            m = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            m[([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)] = True
            self._stop_masks[key] = m
        return m
