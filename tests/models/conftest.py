"""One tiny model built per test session (a build takes seconds), shared by the tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("asyncflow_cache")


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    from asyncflow.models import ensure_tiny_model

    return ensure_tiny_model(cache_dir=tiny_cache)
