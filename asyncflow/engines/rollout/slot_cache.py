"""KV caches for continuous batching with Hugging Face decoder layers.

``SlotKVCache`` holds the running batch: one buffer per layer [slots, kv_heads, capacity,
head_dim]; the running rows occupy slots [0, n) and each row has its own length (no
padding on the left: row r's tokens sit at positions [0, len_r)). A decode step writes
each row's new key at its own position. Rows join at the end and leave by compaction:
survivors past the new end move into the holes, so a finished row costs one row copy,
not a copy of the whole batch.

``PrefillCache`` is a staging cache for prompts entering the batch: rows that each hold
several prompts packed end to end (the engine's block-diagonal mask keeps each prompt to
itself), or one long prompt filled chunk by chunk across engine steps. Each prompt's
positions are then copied into its slot.

The attention layers only call ``update(key, value, layer_idx, ...)``; the engine builds
the attention masks itself (HF models take a dict mask as already prepared).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["PrefillCache", "SlotKVCache"]


def _layer(store: list[torch.Tensor | None], i: int, what: str) -> torch.Tensor:
    """Layer ``i``'s buffer of ``store``; raise when none is allocated (nothing was written yet)."""
    t = store[i]
    if t is None:
        raise RuntimeError(f"{what}: layer {i} has no buffer (no prefill has written to it)")
    return t


class PrefillCache:
    """Staging cache: writes at positions [offset, offset + q) for all its rows."""

    def __init__(self, num_layers: int, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.offset = 0  # where the next chunk's states go

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None or v is None:
            _, h, _, d = key_states.shape
            k = key_states.new_zeros((self.rows, h, self.capacity, d))
            v = value_states.new_zeros((self.rows, value_states.shape[1], self.capacity, value_states.shape[3]))
            self.keys[layer_idx], self.values[layer_idx] = k, v
        end = self.offset + key_states.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"prefill cache overflow in layer {layer_idx}: {end} positions > {self.capacity}")
        k[:, :, self.offset:end] = key_states
        v[:, :, self.offset:end] = value_states
        return k[:, :, :end], v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset


class SlotKVCache:
    """The running batch's cache; ``lens[r]`` positions of row r are filled."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.n = 0  # running rows (slots [0, n))
        self.lens: torch.Tensor | None = None  # int64 [n], on the cache's device
        self._rows_idx: torch.Tensor | None = None  # arange(n), for the decode write

    @property
    def row_lens(self) -> torch.Tensor:
        """``lens`` of the running rows; raise when there are none."""
        if self.lens is None:
            raise RuntimeError("SlotKVCache: no running rows (append() first)")
        return self.lens

    @property
    def slots(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    # ---- growth --------------------------------------------------------------------------
    def reserve(self, slots: int, capacity: int, like: PrefillCache, max_slots: int) -> None:
        """Make room for ``slots`` rows of ``capacity`` positions (grown geometrically up to
        ``max_slots`` rows; kept between steps, so growth stops once the batch is at its size)."""
        if self.keys[0] is not None and slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = self.slots if slots <= self.slots else min(max(slots, self.slots * 3 // 2), max(max_slots, slots))
        new_cap = max(capacity, self.capacity + self.capacity // 4) if capacity > self.capacity else self.capacity
        for i in range(self.num_layers):
            for store, src in ((self.keys, like.keys[i]), (self.values, like.values[i])):
                old = store[i]
                proto = old if old is not None else src
                if proto is None:
                    raise RuntimeError(f"SlotKVCache.reserve: the staging cache has no layer {i} to size the slots by")
                buf = proto.new_zeros((new_slots, proto.shape[1], new_cap, proto.shape[3]))
                if old is not None and self.n:
                    buf[:self.n, :, :old.shape[2]] = old[:self.n]
                store[i] = buf

    # ---- rows in and out -----------------------------------------------------------------
    def append(self, places: list[tuple[PrefillCache, int, int]], lengths: list[int]) -> None:
        """Copy prefilled sequences into slots [n, n + m): sequence j's ``lengths[j]`` positions start
        at ``places[j] = (staging cache, row, offset)`` (packed rows hold several sequences)."""
        m = len(places)
        self._copy_in(range(self.n, self.n + m), places, lengths)
        lens = torch.tensor(lengths, dtype=torch.int64, device=_layer(self.keys, 0, "SlotKVCache.append").device)
        self.lens = lens if self.lens is None or self.n == 0 else torch.cat([self.lens[:self.n], lens])
        self.n += m
        self._rows_idx = None

    def overwrite(self, slots: list[int], places: list[tuple[PrefillCache, int, int]], lengths: list[int]) -> None:
        """Replace the cache of running rows ``slots`` with prefilled sequences (recompute after a swap)."""
        self._copy_in(slots, places, lengths)
        lens = self.row_lens
        lens[torch.tensor(slots, device=lens.device)] = torch.tensor(lengths, dtype=torch.int64, device=lens.device)

    def _copy_in(self, slots: Iterable[int], places: list[tuple[PrefillCache, int, int]], lengths: list[int]) -> None:
        """One gather and one scatter per layer per staging cache (not one copy per sequence: on
        an accelerator each copy is a kernel launch). A slot's positions past its sequence get
        what follows it in the staging row: past the row's length, never attended to, and
        overwritten by the decode steps that reach them."""
        groups: dict[int, tuple[PrefillCache, list[tuple[int, int, int, int]]]] = {}
        for slot, (staged, row, start), n in zip(slots, places, lengths):
            groups.setdefault(id(staged), (staged, []))[1].append((slot, row, start, n))
        dev = _layer(self.keys, 0, "SlotKVCache").device
        for staged, members in groups.values():
            dst, rows, starts, ns = (torch.tensor(c, device=dev) for c in zip(*members))
            t = torch.arange(int(ns.max()), device=dev)[None, :]
            src_pos = (starts[:, None] + t).clamp(max=_layer(staged.keys, 0, "PrefillCache").shape[2] - 1)
            for i in range(self.num_layers):
                _layer(self.keys, i, "SlotKVCache")[dst[:, None], :, t] = \
                    _layer(staged.keys, i, "PrefillCache")[rows[:, None], :, src_pos]
                _layer(self.values, i, "SlotKVCache")[dst[:, None], :, t] = \
                    _layer(staged.values, i, "PrefillCache")[rows[:, None], :, src_pos]

    def compact(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the rows where bool ``keep`` [n] is set; return ``order``: new slot j holds the row
        that was in slot order[j] (the caller reorders its own per-row state alike)."""
        n = self.n
        order = torch.arange(n)
        keep_cpu = keep.cpu()
        n_new = int(keep_cpu.sum())
        holes = (~keep_cpu[:n_new]).nonzero().squeeze(1)  # finished rows inside the new range
        movers = n_new + keep_cpu[n_new:].nonzero().squeeze(1)  # survivors past it
        lens = self.row_lens
        if holes.numel():
            dev = _layer(self.keys, 0, "SlotKVCache.compact").device
            h, mv = holes.to(dev), movers.to(dev)
            for store in (self.keys, self.values):
                for i in range(self.num_layers):
                    buf = _layer(store, i, "SlotKVCache.compact")
                    buf.index_copy_(0, h, buf.index_select(0, mv))
            lens[h] = lens[mv]
            order[holes] = movers
        self.n = n_new
        self.lens = lens[:n_new]
        self._rows_idx = None
        return order[:n_new]

    def clear(self) -> None:
        """No running rows; buffers are kept for the next ones."""
        self.n = 0
        self.lens = None
        self._rows_idx = None

    def release(self) -> None:
        """Drop the buffers (memory back to the allocator)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.clear()

    # ---- what the attention layers call during a decode step -----------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token [n, kv_heads, 1, head_dim] per row at its own position ``lens[r]``;
        return the keys/values of positions [0, max(lens) + 1) (masked per row by the engine)."""
        n = self.n
        if self._rows_idx is None or self._rows_idx.numel() != n:
            self._rows_idx = torch.arange(n, device=key_states.device)
        k, v, lens = self.keys[layer_idx], self.values[layer_idx], self.lens
        if k is None or v is None or lens is None:
            raise RuntimeError(f"SlotKVCache.update: layer {layer_idx} decoded with no running rows in the cache")
        k[self._rows_idx, :, lens] = key_states[:, :, 0]
        v[self._rows_idx, :, lens] = value_states[:, :, 0]
        end = self.decode_width
        return k[:n, :, :end], v[:n, :, :end]

    @property
    def decode_width(self) -> int:
        """Positions a decode step attends to: the longest row plus the token being written."""
        return self._width

    def begin_decode(self) -> int:
        """Fix the width of this decode step (before the forward) and return it."""
        self._width = int(self.row_lens.max()) + 1
        if self._width > self.capacity:
            raise RuntimeError(f"KV cache overflow: a row needs {self._width} positions, capacity {self.capacity}")
        return self._width

    def end_decode(self) -> None:
        self.lens = self.row_lens + 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.lens is None or self.n == 0 else int(self.lens.max())
