"""Session-wide: the multi-process tests share one xdist worker; with ASYNCFLOW_REQUIRE_VLLM=1
(CI's vLLM stage) a skipped ``vllm`` test fails the run."""
from __future__ import annotations

import os

import pytest

_skipped_vllm: list[str] = []
# pytest.ini runs two xdist workers (--dist loadgroup): every test marked slow (a few processes
# each) goes to the worker of this group, one after another, as on a 2-core machine they are
# timed for; the single-process tests run on the other worker beside them.
MULTI_PROCESS_GROUP = "multi_process"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group(MULTI_PROCESS_GROUP))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "vllm" in report.keywords:
        _skipped_vllm.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("ASYNCFLOW_REQUIRE_VLLM", "") == "1" and _skipped_vllm:
        print(f"\nASYNCFLOW_REQUIRE_VLLM=1: {len(_skipped_vllm)} vLLM tests were skipped: {_skipped_vllm[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
