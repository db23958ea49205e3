"""Per-row deterministic sampling: Gumbel-max with counter-based noise.

Why not one torch.Generator per row: that costs a Python call per row per step. Here the
noise for (row seed, step, token) comes from an integer hash computed for the whole
[rows, vocab] block in a few tensor ops, so a row's noise - hence its sample - does not
depend on which other rows share the batch, nor on their order, and the per-step Python
work is constant.

argmax(filtered_logits / T + Gumbel) samples from softmax over the kept tokens (the
Gumbel-max trick); the returned log-prob is taken from the unfiltered softmax(logits / T).
"""
from __future__ import annotations

import torch

__all__ = ["SeedKeys", "sample_step", "gumbel_noise", "filter_top_k_top_p"]

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: the products of a 32-bit value stay below 2**63, so int64
# arithmetic never overflows (signed overflow is not something to rely on).
_M1 = 0x7FEB352D
_M2 = 0x5BD1E995
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _splitmix64(seed: int) -> int:
    """Spread a user seed (any int) over 64 bits, so nearby seeds give unrelated keys."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class SeedKeys:
    """Two 32-bit hash keys per row, derived from the row's seed."""

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu") -> None:
        mixed = [_splitmix64(int(s)) for s in seeds]
        self.a = torch.tensor([m & _MASK32 for m in mixed], dtype=torch.int64, device=device)
        self.b = torch.tensor([m >> 32 for m in mixed], dtype=torch.int64, device=device)

    def select(self, rows: torch.Tensor) -> SeedKeys:
        return SeedKeys.of(self.a[rows], self.b[rows])

    @staticmethod
    def of(a: torch.Tensor, b: torch.Tensor) -> SeedKeys:
        """Keys from their two int64 halves (rows kept elsewhere, e.g. in a running batch)."""
        out = SeedKeys.__new__(SeedKeys)
        out.a, out.b = a, b
        return out


def gumbel_noise(keys: SeedKeys, step: int | torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [rows, vocab], a pure function of (row key, step, token id).

    step: one int for all rows, or an int64 tensor [rows] (each row's own token index).

    vocab_hash: `_mix32(arange(V) + const)`, computed once per generate (see `vocab_hash`).
    """
    row = _mix32(keys.a ^ _mix32(((step * _GOLDEN) + keys.b) & _MASK32))  # [rows]
    x = _mix32(row[:, None] ^ vocab_hash[None, :])
    x = _mix32(x ^ keys.b[:, None])
    # 23 bits: (k + 0.5) * 2**-23 is exact in float32 and strictly inside (0, 1), so the
    # logs below are finite; the tail lost beyond probability 2**-24 is immaterial.
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))


def vocab_hash(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return _mix32((torch.arange(vocab_size, dtype=torch.int64, device=device) * _GOLDEN + 0x632BE5AB) & _MASK32)


def filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf; top-k first, as in HF and vLLM.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (the
    most likely token is always kept).
    """
    out = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive cumulative mass
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_step(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, keys: SeedKeys | None,
                step: int | torch.Tensor, vhash: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from float32 logits [rows, vocab]; return (tokens int64, log-probs float32).

    Greedy (temperature 0): argmax, log-prob under softmax(logits). Otherwise the token is
    drawn from the filtered softmax(logits / T) and its log-prob is under the unfiltered one.
    """
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        scaled = logits
    else:
        if keys is None or vhash is None:
            raise ValueError("sampling with temperature > 0 needs seed keys and the vocab hash")
        scaled = logits / temperature if temperature != 1.0 else logits
        filtered = filter_top_k_top_p(scaled, top_k, top_p)
        tokens = torch.argmax(filtered + gumbel_noise(keys, step, vhash), dim=-1)
    chosen = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    log_probs = chosen - torch.logsumexp(scaled, dim=-1)
    return tokens, log_probs
