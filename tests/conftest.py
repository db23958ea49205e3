"""Session-wide: the end-to-end runs share one xdist worker; with ASYNCFLOW_REQUIRE_VLLM=1 (CI's
vLLM stage) a skipped ``vllm`` test fails the run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

_skipped_vllm: list[str] = []
# pytest.ini runs two xdist workers (--dist loadgroup): the tests of tests/e2e (each a whole
# `asyncflow train` job, two or three ranks on a 2-core machine) and every test marked vllm (a
# vLLM engine polls its workers on the cores it finds) go to the worker of this group, one after
# another, so that no two of them share the cores; every other test goes to whichever worker is free.
E2E_GROUP = "e2e_runs"
E2E_DIR = Path(__file__).resolve().parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(item.path).parents or item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.xdist_group(E2E_GROUP))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "vllm" in report.keywords:
        _skipped_vllm.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("ASYNCFLOW_REQUIRE_VLLM", "") == "1" and _skipped_vllm:
        print(f"\nASYNCFLOW_REQUIRE_VLLM=1: {len(_skipped_vllm)} vLLM tests were skipped: {_skipped_vllm[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
