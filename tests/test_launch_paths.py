"""`asyncflow train` checks the run's local paths before any rank starts: a wrong path exits 2
at once naming its key, and nothing of the run is written."""
from __future__ import annotations

import pytest

from asyncflow.config import ConfigError, load_config


def _train(tmp_path, *overrides: str) -> int:
    from asyncflow.launcher import train_main
    return train_main(["grpo", f"trainer.out_dir={tmp_path / 'out'}", *overrides])


def test_a_missing_model_path_exits_2_naming_the_key_before_anything_starts(tmp_path, capsys):
    assert _train(tmp_path, f"model.path={tmp_path / 'no_model'}") == 2
    err = capsys.readouterr().err
    assert f"model.path={tmp_path / 'no_model'}" in err and "does not exist" in err and "never downloads" in err
    assert not (tmp_path / "out").exists()  # no run_config.yaml, no ranks


def test_a_missing_prompt_file_exits_2_naming_the_key(tmp_path, capsys):
    assert _train(tmp_path, "data.task=file", f"data.path={tmp_path / 'prompts.jsonl'}") == 2
    err = capsys.readouterr().err
    assert "data.path=" in err and "does not exist" in err
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert _train(tmp_path, "data.task=file", f"data.path={tmp_path / 'prompts.jsonl'}",
                  f"data.eval_path={tmp_path}") == 2
    assert "data.eval_path=" in capsys.readouterr().err


def test_a_reward_model_path_that_is_no_reward_model_exits_2(tmp_path, capsys):
    from asyncflow.training.trainer import resolve_model
    policy = resolve_model(load_config(None, []))  # the built-in tiny causal LM
    assert _train(tmp_path, f"reward.model_path={policy}") == 2
    err = capsys.readouterr().err
    assert "reward.model_path=" in err and "ForSequenceClassification" in err


def test_under_torchrun_a_node_checks_only_what_it_reads(tmp_path):
    """Every node loads model.path; prompt files are read on the driver's node; the reward
    model's node depends on the placement, so only a local launch checks it."""
    from asyncflow.launcher import check_paths
    from asyncflow.training.trainer import resolve_model
    cfg = load_config(None, ["data.task=file", f"data.path={tmp_path / 'none.jsonl'}",
                             f"reward.model_path={tmp_path / 'no_rm'}"])
    cfg.model.path = resolve_model(cfg)
    check_paths(cfg, driver_node=False, every_role_here=False)  # another node: nothing it reads is wrong
    with pytest.raises(ConfigError, match="data.path="):
        check_paths(cfg, driver_node=True, every_role_here=False)
    with pytest.raises(ConfigError, match="reward.model_path="):
        check_paths(cfg, driver_node=False, every_role_here=True)
    cfg.model.path = str(tmp_path / "no_model")
    with pytest.raises(ConfigError, match="model.path="):
        check_paths(cfg, driver_node=False, every_role_here=False)


def test_a_budget_that_fills_the_context_exits_2(tmp_path, capsys):
    """The tiny model's context is 128 tokens: a budget of 128 leaves no room for any prompt."""
    assert _train(tmp_path, "rollout.max_new_tokens=128") == 2
    err = capsys.readouterr().err
    assert "rollout.max_new_tokens=128" in err and "context of 128 tokens" in err


def test_the_resume_hint_repeats_the_command_with_resume_auto(tmp_path):
    import shlex

    from asyncflow.launcher import resume_hint
    from asyncflow.workflow.checkpoints import STATE_FILE
    argv = ["grpo", "trainer.resume=", "placement.actor_ranks=[0, 1]", f"trainer.out_dir={tmp_path}"]
    assert "no checkpoint was written" in resume_hint(tmp_path, argv)
    for step in (3, 7):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / STATE_FILE).write_text("{}")
    hint = resume_hint(tmp_path, argv)
    assert "step_7" in hint
    cmd = shlex.split(hint.split("to go on from it: ", 1)[1])
    assert cmd == ["asyncflow", "train", "grpo", "placement.actor_ranks=[0, 1]", f"trainer.out_dir={tmp_path}",
                   "trainer.resume=auto"]


def test_an_out_dir_that_cannot_be_written_exits_2_naming_the_key(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    assert _train(tmp_path, f"trainer.out_dir={tmp_path / 'a_file'}") == 2  # (the last out_dir wins)
    err = capsys.readouterr().err
    assert f"trainer.out_dir={tmp_path / 'a_file'}: the run cannot write there" in err
    assert (tmp_path / "a_file").read_text() == "x"  # nothing it held is touched


def test_ranks_without_a_role_are_named_rank_0_aside():
    from asyncflow.launcher import idle_ranks
    assert idle_ranks(load_config(None, ["trainer.nproc=4"])) == [2, 3]
    assert idle_ranks(load_config(None, ["trainer.nproc=3", "placement.actor_ranks=[1]",
                                         "placement.rollout_ranks=[2]"])) == []  # rank 0: the driver's
    assert idle_ranks(load_config(None, ["trainer.nproc=4", "placement.mode=colocated"])) == []


def test_a_stop_file_that_exists_already_exits_2_and_leaves_it(tmp_path, capsys):
    """It would end RL at its first step: refused at start, naming the key; the file stays."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "STOP").write_text("")
    assert _train(tmp_path, "trainer.stop_file=STOP") == 2
    err = capsys.readouterr().err
    assert "trainer.stop_file=STOP" in err and "exists already" in err and "remove it" in err
    assert (tmp_path / "out" / "STOP").exists()
