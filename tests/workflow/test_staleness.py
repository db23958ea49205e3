"""The staleness rule t - k, in one function that every weights gate asks."""
from __future__ import annotations

from asyncflow.simulation.cluster import ClusterConfig
from asyncflow.workflow.executor import ExecutorConfig
from asyncflow.workflow.staleness import allowed_lag, min_version


def test_only_async_mode_allows_stale_weights():
    assert allowed_lag("async", 2) == 2
    assert allowed_lag("stream", 2) == 0 and allowed_lag("sync", 2) == 0


def test_the_oldest_version_a_step_may_use_is_t_minus_k_never_below_zero():
    assert [min_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]
    assert [min_version(t, 0) for t in range(3)] == [0, 1, 2]


def test_the_executor_and_the_simulator_use_the_rule():
    assert ExecutorConfig(mode="async", max_staleness=3).lag == 3
    assert ExecutorConfig(mode="sync", max_staleness=3).lag == 0
    assert ClusterConfig(mode="async", max_staleness=2).tail == 2
