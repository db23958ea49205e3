"""A preallocated, row-shrinkable KV cache for Hugging Face decoder layers.

Why not transformers' DynamicCache: it grows by torch.cat every step (a copy of the
whole cache per layer per token). Here each layer owns one buffer [rows, kv_heads,
capacity, head_dim] written in place; finished rows are dropped with one index_select.

The attention layers only call `update(key, value, layer_idx, ...)`; the engine builds
the attention masks itself (a dict mask, which HF models take as already prepared), so
none of transformers' mask machinery asks this object anything else.
"""
from __future__ import annotations

import torch

__all__ = ["RowKVCache"]


class RowKVCache:
    """Left-aligned cache: all rows share one write position (prompts are left padded)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers
        # Set by `prefill_target`: while prefilling a chunk of rows, writes go to rows
        # [r0, r1) at positions [offset, offset + q) instead of all rows at the end.
        self._target: tuple[int, int, int] | None = None
        self._rows: int | None = None

    def allocate_rows(self, rows: int) -> None:
        """Fix the row count before a chunked prefill (buffers are created on first update)."""
        self._rows = rows

    def prefill_target(self, r0: int, r1: int, offset: int) -> None:
        self._target = (r0, r1, offset)

    def end_prefill(self, length: int) -> None:
        """After the last prefill chunk: every row's cache is `length` positions long."""
        self._target = None
        self.lengths = [length] * len(self.lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [rows, kv_heads, q, head_dim] states; return views of everything cached so far."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None:  # first call (prefill) fixes rows, heads, head_dim, dtype, device
            b, h, _, d = key_states.shape
            b = self._rows if self._rows is not None else b
            # Zeros, not empty: slots left of a chunk's padding are never written but are read
            # (masked, weight exactly 0) - and 0 * NaN garbage would still be NaN.
            k = key_states.new_zeros((b, h, self.capacity, d))
            v = value_states.new_zeros((b, value_states.shape[1], self.capacity, value_states.shape[3]))
            self.keys[layer_idx], self.values[layer_idx] = k, v
        if self._target is not None:
            r0, r1, off = self._target
            end = off + key_states.shape[2]
            k[r0:r1, :, off:end] = key_states
            v[r0:r1, :, off:end] = value_states
            return k[r0:r1, :, off:end], v[r0:r1, :, off:end]
        start = self.lengths[layer_idx]
        end = start + key_states.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow in layer {layer_idx}: {end} positions > capacity {self.capacity}")
        k[:, :, start:end] = key_states
        v[:, :, start:end] = value_states
        self.lengths[layer_idx] = end
        return k[:, :, :end], v[:, :, :end]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (an index tensor into the current rows), in that order."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                # One gather over the whole buffer: simpler than copying only the filled
                # part, and at most ~2x the bytes of it.
                self.keys[i] = k.index_select(0, rows)
                self.values[i] = v.index_select(0, rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers allocated so far (what the engine reports as held)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
