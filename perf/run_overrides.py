"""The KEY=VALUE overrides a benchmark hands to its ``asyncflow train`` runs, checked one way
for every benchmark: each must be ``key=value``, and none may name a key the benchmark sets
itself per run (it would be overridden without a word, or break the measurement)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def check_overrides(overrides: Sequence[str], owned: Mapping[str, str]) -> None:
    """Raise ValueError for an override that is not ``key=value`` or that names a key of
    ``owned`` (key -> how the benchmark lets you set it, e.g. ``{"trainer.seed": "--seeds"}``)."""
    for item in overrides:
        key, eq, _ = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. trainer.prompts_per_step=16)")
        if key in owned:
            raise ValueError(f"override {item!r}: {key} is set by the benchmark for each run (use {owned[key]})")
