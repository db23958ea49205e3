"""A column as ``get_data`` hands it out (``columns.to_tensordict``: a tensor, a jagged nested
tensor, a NonTensorStack) read as one Python entry per row: what a worker or an episode
runner iterates over."""
from __future__ import annotations

from typing import Any

import torch


def rows(column: Any) -> list[torch.Tensor]:
    """A jagged column (nested tensor) or a list as one 1-D tensor per row."""
    if isinstance(column, (list, tuple)):
        return [torch.as_tensor(x) for x in column]
    if getattr(column, "is_nested", False):
        return list(column.unbind())
    return list(column)


def values(column: Any) -> list[Any]:
    """A non-tensor column (strings, dicts) as a Python list."""
    tolist = getattr(column, "tolist", None)
    return list(tolist()) if tolist is not None else list(column)
