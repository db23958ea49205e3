"""Shared fixtures of the metrics tests: one synthetic run, reported once per module."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
from _metrics_run import write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails unless it starts like a real PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> tuple[Path, int, int]:
    """(run dir, metric rows, spans) of a 300-step run over 3 lanes."""
    out_dir = tmp_path_factory.mktemp("run")
    n_rows, n_spans = write_run(out_dir, steps=300)
    return out_dir, n_rows, n_spans
