"""The end-to-end tests' shared fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest
from _run import ok, train_as_is


def start_overrides(warm_dir: Path) -> list[str]:
    """What starts a run from an exported policy, as a user's local checkpoint starts one (eager
    attention, as the built-in model has)."""
    return [f"model.path={(warm_dir / 'hf_model').resolve()}", "model.attn_implementation=eager",
            "warmup.enabled=false"]


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The main job's supervised warm-up, run once per test session: the learning tests start RL
    from its exported policy (``trainer.steps=0`` stops the run after the warm-up and exports)."""
    out = tmp_path_factory.mktemp("warm") / "run"
    ok(train_as_is(out, "grpo", "trainer.steps=0", "trainer.eval_every=0", timeout=600))
    assert (out / "hf_model" / "config.json").is_file(), f"the warm-up exported no policy in {out}"
    return start_overrides(out)
