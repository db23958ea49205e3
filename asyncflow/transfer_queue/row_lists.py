"""A column read as one Python entry per row: what a worker or an episode runner iterates over.

Takes a column as ``get_data`` hands it out (``columns.to_tensordict``: a tensor, a jagged
nested tensor, a NonTensorStack) or as ``get_columns`` does (a ``Column``): readers that
only iterate rows take the columns themselves and skip building a TensorDict, its nested
tensors and its per-row non-tensor objects, only to take them apart again."""
from __future__ import annotations

from typing import Any

import torch

from .columns import FixedColumn, JaggedColumn, ObjectColumn


def rows(column: Any) -> list[torch.Tensor]:
    """A jagged column (nested tensor, or JaggedColumn) or a list as one 1-D tensor per row."""
    if isinstance(column, JaggedColumn):  # views of the values, as a nested tensor's unbind gives
        return list(torch.split(column.values, column.lengths().tolist())) if len(column) else []
    if isinstance(column, FixedColumn):
        return list(column.data)
    if isinstance(column, (list, tuple)):
        return [torch.as_tensor(x) for x in column]
    if getattr(column, "is_nested", False):
        return list(column.unbind())
    return list(column)


def tensor(column: Any) -> torch.Tensor:
    """A column of one value (or one fixed-shape tensor) per row as one tensor: a FixedColumn's
    data, a tensor as it is."""
    return column.data if isinstance(column, FixedColumn) else column


def values(column: Any) -> list[Any]:
    """A non-tensor column (strings, dicts; a NonTensorStack or ObjectColumn) or a tensor of one
    value per row (a tensor or FixedColumn) as a Python list."""
    if isinstance(column, ObjectColumn):
        return list(column.items)
    if isinstance(column, FixedColumn):
        return column.data.tolist()
    tolist = getattr(column, "tolist", None)
    return list(tolist()) if tolist is not None else list(column)
