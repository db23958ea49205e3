"""trainer.stop_file: RL ends after the step during which the file appeared, as a time budget
ends it; a relative path lies under out_dir; "" turns it off."""
from __future__ import annotations

import asyncio

from asyncflow.config import load_config
from asyncflow.training.observers import StopFile
from asyncflow.workflow.step_report import StepReport


def _report(step: int) -> StepReport:
    return StepReport(step=step, metrics={}, timing={}, rows=0, started=0.0, finished=0.0)


def test_the_path_is_off_by_default_relative_to_out_dir_or_absolute(tmp_path):
    assert load_config(None, []).trainer.stop_path() is None
    cfg = load_config(None, [f"trainer.out_dir={tmp_path / 'run'}", "trainer.stop_file=STOP"])
    assert cfg.trainer.stop_path() == tmp_path / "run" / "STOP"
    cfg = load_config(None, [f"trainer.stop_file={tmp_path / 'elsewhere'}"])
    assert cfg.trainer.stop_path() == tmp_path / "elsewhere"


def test_steps_go_on_until_the_file_appears_then_the_run_is_stopped(tmp_path):
    stops: list[int] = []
    obs = StopFile(tmp_path / "STOP", lambda: stops.append(1))
    assert not obs.holds_training(0)

    async def go() -> None:
        await obs.step_done(_report(0))
        await obs.step_done(_report(1))
        assert stops == []
        (tmp_path / "STOP").write_text("")
        await obs.step_done(_report(2))
        await obs.step_done(_report(3))  # a step already issued reports after the stop
    asyncio.run(go())
    assert len(stops) == 1
