"""Shared fixtures of the metrics tests: one synthetic run, reported once per module."""
from __future__ import annotations

from pathlib import Path

import pytest
from _metrics_run import write_run


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> tuple[Path, int, int]:
    """(run dir, metric rows, spans) of a 300-step run over 3 lanes."""
    out_dir = tmp_path_factory.mktemp("run")
    n_rows, n_spans = write_run(out_dir, steps=300)
    return out_dir, n_rows, n_spans
