"""docs/porting.md's ported verl command is a valid run configuration, key for key."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from asyncflow.config import load_config
from asyncflow.launcher import parse_train_args

DOC = Path(__file__).resolve().parents[1] / "docs" / "porting.md"


def test_the_ported_command_loads_with_the_settings_it_claims():
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    ported = [b for b in blocks if b.lstrip().startswith("asyncflow train")]
    assert len(ported) == 1, blocks
    argv = shlex.split(ported[0].replace("\\\n", " "))[2:]
    recipe, overrides = parse_train_args(argv)
    assert recipe == "grpo"
    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "grpo" / "config.yaml", overrides)
    assert cfg.data.task == "file" and cfg.data.prompt_key == "prompt" and cfg.data.answer_key == "answer"
    assert cfg.reward.custom_path == "my_reward.py" and cfg.reward.custom_name == "compute_score"
    assert cfg.algorithm.kl_coef == 0.001 and cfg.algorithm.kl_estimator == "k3"
    assert cfg.algorithm.dynamic_sampling is False and cfg.trainer.time_budget_s == 0
