"""perf/run_overrides.py: the one check of the KEY=VALUE overrides that the benchmarks hand to
their runs; each benchmark refuses the keys it sets per run, naming the flag that sets them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
from run_overrides import check_overrides  # noqa: E402


def test_key_value_overrides_pass_and_owned_keys_are_refused_naming_the_flag():
    owned = {"trainer.seed": "--seed"}
    check_overrides(["rollout.n=4", "placement.ref_with=rollout", "trainer.loggers=[jsonl]"], owned)
    with pytest.raises(ValueError, match=r"trainer.seed is set by the benchmark for each run \(use --seed\)"):
        check_overrides(["trainer.seed = 3"], {"trainer.seed": "--seed"})
    for bad in ("trainer.steps", "=3", ""):
        with pytest.raises(ValueError, match="expected key=value"):
            check_overrides([bad], {})


@pytest.mark.parametrize("script, override, flag", [
    ("cpu_account.py", "trainer.seed=3", "--seed"),
    ("cpu_account.py", "trainer.steps=10", "--steps"),
    ("soak.py", "trainer.out_dir=/tmp/x", "--out"),
    ("convergence.py", "trainer.seed=1", "--seeds"),
])
def test_each_benchmark_refuses_what_it_sets_before_running_anything(script, override, flag):
    proc = subprocess.run([sys.executable, str(PERF / script), override], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(PERF.parent)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"use {flag}" in proc.stderr
