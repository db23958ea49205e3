"""Session-wide: with ASYNCFLOW_REQUIRE_VLLM=1 (CI's vLLM stage) a skipped ``vllm`` test fails the run."""
from __future__ import annotations

import os

import pytest

_skipped_vllm: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "vllm" in report.keywords:
        _skipped_vllm.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("ASYNCFLOW_REQUIRE_VLLM", "") == "1" and _skipped_vllm:
        print(f"\nASYNCFLOW_REQUIRE_VLLM=1: {len(_skipped_vllm)} vLLM tests were skipped: {_skipped_vllm[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
