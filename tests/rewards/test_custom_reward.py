"""A reward function written for verl (reward.custom_path / reward.custom_name) runs unchanged:
called with verl's keywords, a float or a dict with 'score' (its other keys summed as extras);
a wrong file, function or return value is refused naming the file, the key and the row."""
from __future__ import annotations

import re

import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.rewards import CustomRewardError, RewardError, RewardRunner, load_file_reward, reward_ref
from asyncflow.rewards.custom import file_ref

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Written for verl: exact match, with the row's metadata echoed as extras."""
    hit = solution_str.strip() == ground_truth
    return {"score": 1.0 if hit else 0.0, "acc": hit, "gsm8k": data_source == "openai/gsm8k",
            "index": extra_info["index"], "pred": solution_str}


def partial(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25 if ground_truth in solution_str else 0


def returns(data_source, solution_str, ground_truth, extra_info=None):
    return {"none": None, "text": "1.0", "noscore": {"acc": 1}}.get(solution_str, 1.0)


def two_args(solution_str, ground_truth):
    return 1.0


NOT_A_FUNCTION = 3
'''


@pytest.fixture()
def reward_file(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(VERL_REWARD)
    return p


def _meta(i, data_source="openai/gsm8k"):
    return {"data_source": data_source, "ability": "math", "prompt": "user:q\nassistant:",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": "train", "index": i}}


def test_a_verl_compute_score_scores_with_verls_arguments_and_its_extras_are_summed(reward_file):
    runner = RewardRunner(file_ref(str(reward_file)))
    scores, stats = runner.score(["7", " 7 ", "8"], ["7", "7", "7"], [_meta(10), _meta(11), _meta(12, "x")])
    assert scores == [1.0, 1.0, 0.0] and stats["errors"] == 0
    assert stats["extra"] == {"acc": [2.0, 3], "gsm8k": [2.0, 3], "index": [33.0, 3]}  # "pred" is text: not summed
    assert runner.name == f"compute_score in {reward_file}"


def test_custom_name_picks_the_function_and_numbers_need_no_dict(reward_file):
    scores, stats = RewardRunner(file_ref(str(reward_file), "partial")).score(["a 7", "8"], ["7", "7"],
                                                                              [_meta(0), _meta(1)])
    assert scores == [0.25, 0.0] and stats["extra"] == {}


def test_reward_ref_reads_the_config(reward_file):
    assert reward_ref(load_config(None, []).reward) == "number"
    cfg = load_config(None, [f"reward.custom_path={reward_file}"])
    assert reward_ref(cfg.reward) == file_ref(str(reward_file), "compute_score")  # verl's default name
    fn = load_file_reward(str(reward_file))
    assert fn is load_file_reward(str(reward_file))  # imported once per process
    with pytest.raises(ConfigError, match="reward.custom_name: 'my-fn' is not a Python function name"):
        load_config(None, [f"reward.custom_path={reward_file}", "reward.custom_name=my-fn"])


@pytest.mark.parametrize("response,got", [
    ("none", r"None \(type NoneType\)"),
    ("text", r"'1.0' \(type str\)"),
    ("noscore", r"a dict without a numeric 'score' \(keys \['acc'\]\)"),
])
def test_a_wrong_return_value_stops_scoring_naming_file_function_and_row(reward_file, response, got):
    runner = RewardRunner(file_ref(str(reward_file), "returns"), on_error="zero")  # no row scored 0 in silence
    with pytest.raises(RewardError) as info:
        runner.score(["ok", response], ["7", "7"], [_meta(0), _meta(5)])
    msg = str(info.value)
    assert f"reward 'returns in {reward_file}' failed on row 1" in msg, msg
    assert f"reward file {reward_file}: returns returned " in msg and re.search(got, msg), msg
    assert "data_source 'openai/gsm8k', extra_info.split 'train', extra_info.index 5" in msg, msg
    assert "reward.custom_path / reward.custom_name" in msg


@pytest.mark.parametrize("name,content,match", [
    ("missing.py", None, r"reward file .*missing\.py does not exist; expected a Python file defining compute_score"),
    ("r.txt", "x = 1", r"r\.txt: not a \.py file"),
    ("r.py", "def other(**kw):\n    return 1\n", (r"r\.py has no function 'compute_score' \(reward.custom_name\); "
                                                  r"it defines: other")),
    ("r.py", "import no_such_module_here\n", r"r\.py: importing it raised ModuleNotFoundError"),
    ("r.py", "def compute_score(:\n", r"r\.py: importing it raised SyntaxError"),
])
def test_a_file_that_cannot_be_used_is_refused_naming_it(tmp_path, name, content, match):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    with pytest.raises(CustomRewardError, match=match):
        load_file_reward(str(p))


@pytest.mark.parametrize("fn,match", [
    ("NOT_A_FUNCTION", r"NOT_A_FUNCTION is 3 \(type int\), not a function"),
    ("two_args", r"two_args\(solution_str, ground_truth\) cannot be called as verl calls it"),
])
def test_a_function_that_verl_could_not_call_is_refused(reward_file, fn, match):
    with pytest.raises(CustomRewardError, match=match):
        load_file_reward(str(reward_file), fn)


def _train(tmp_path, *overrides: str) -> int:
    from asyncflow.launcher import train_main
    return train_main(["grpo", f"trainer.out_dir={tmp_path / 'out'}", *overrides])


def test_the_launcher_checks_the_reward_file_before_any_rank_starts(tmp_path, reward_file, capsys):
    assert _train(tmp_path, f"reward.custom_path={tmp_path / 'nope.py'}") == 2
    err = capsys.readouterr().err
    assert f"reward.custom_path={tmp_path / 'nope.py'}" in err and "does not exist" in err, err
    assert _train(tmp_path, f"reward.custom_path={reward_file}", "reward.custom_name=compute_scor") == 2
    err = capsys.readouterr().err
    assert "reward.custom_path=" in err and "no function 'compute_scor' (reward.custom_name)" in err, err
    assert not (tmp_path / "out").exists()  # nothing of the run was written


def test_under_torchrun_the_reward_file_is_checked_only_where_every_role_runs(tmp_path):
    from asyncflow.launcher import check_paths
    from asyncflow.training.trainer import resolve_model
    cfg = load_config(None, [f"reward.custom_path={tmp_path / 'nope.py'}"])
    cfg.model.path = resolve_model(cfg)
    check_paths(cfg, driver_node=True, every_role_here=False)
    with pytest.raises(ConfigError, match="reward.custom_path="):
        check_paths(cfg, driver_node=True, every_role_here=True)


def test_the_reward_stage_scores_with_the_file_and_keeps_the_extras(tmp_path, reward_file):
    """RowScorer (the reward stage's and inline scoring's) adds up the extras over its calls."""
    import torch

    from asyncflow.models import load_tokenizer
    from asyncflow.training.trainer import resolve_model
    from asyncflow.workers.reward import RowScorer
    cfg = load_config(None, [f"reward.custom_path={reward_file}"])
    path = resolve_model(cfg)
    tok = load_tokenizer(path)
    scorer = RowScorer(cfg.reward, tok, {tok.eos_token_id})
    ids = [torch.tensor(tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]) for t in ("7", "8")]
    assert scorer.score(ids, ["7", "7"], ["p", "p"], [_meta(1), _meta(2)]).tolist() == [1.0, 0.0]
    assert scorer.score(ids[:1], ["7"], ["p"], [_meta(3)]).tolist() == [1.0]
    stats = scorer.stats()
    assert stats["reward/errors"] == 0
    assert stats["reward/extra"] == {"acc": [2.0, 3], "gsm8k": [3.0, 3], "index": [6.0, 3]}
