"""Test helper: a light assert_close.

torch.testing.assert_close lazily imports torch.distributed.tensor on first use, which costs
seconds on a loaded 2-core machine; these tests compare small dense tensors only.
"""
from __future__ import annotations

import torch

_DEFAULT_TOL = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5),
                torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None,
                 atol: float | None = None, equal_nan: bool = False) -> None:
    """Same shape, same dtype, and |actual - expected| <= atol + rtol * |expected| elementwise."""
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    d_rtol, d_atol = _DEFAULT_TOL.get(actual.dtype, (0.0, 0.0))
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    a, e = actual.detach(), expected.detach()
    ok = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    assert bool(ok.all()), f"not close (rtol={rtol}, atol={atol}):\nactual   {a}\nexpected {e}"
