"""Fixtures of the single-controller tests; the helpers live in _sc_cluster.py."""
from __future__ import annotations

import pytest
from _sc_cluster import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def cluster3():
    """Three worker ranks, colocated by default; tests name ranks explicitly when needed."""
    c = start_cluster(3)
    yield c
    stop_cluster(c)
