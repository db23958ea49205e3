"""Recipes declare their algorithm: roles (worker classes, placement), stages and the columns
each reads and writes. Pins: the built-in recipes build for their configs; a recipe in any
directory is imported as a package (so recipes share code by importing each other); every
mistake in a declaration fails at start with the recipe file and the stage or role named."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.training.trainer import source_columns
from asyncflow.workflow.recipe import available, find_recipe


def _build(name_or_dir, *overrides):
    r = find_recipe(str(name_or_dir))
    cfg = load_config(r.config, list(overrides))
    return r.build(cfg, source_columns(cfg))


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "remax"])
@pytest.mark.parametrize("extra", [[], ["algorithm.kl_coef=0.1"]])
def test_builtin_recipes_declare_valid_algorithms(name, extra):
    assert name in available()
    spec = _build(name, *extra)
    names = [s.name for s in spec.stages]
    assert spec.stages[-1].kind == "update" and spec.policy == "actor" and spec.rollout_role == "rollout"
    assert ("ref_log_prob" in names) == bool(extra) and ("ref" in spec.roles) == bool(extra)
    # advantages are computed once, by their own stage, and the update reads them
    adv = [s for s in spec.stages if "advantages" in s.outputs]
    assert len(adv) == 1 and adv[0].role == "driver" and "advantages" in spec.update.inputs


def test_recipes_share_code_by_importing_each_other():
    import recipes.grpo.recipe as grpo  # importable once any recipe was found
    spec = _build("dapo")
    assert [s.name for s in spec.stages][:2] == ["rollout", "reward"]
    assert spec.roles.keys() == grpo.roles(load_config(find_recipe("dapo").config)).keys()
    assert "overlong" in [s.name for s in spec.stages]  # DAPO's own stage, shaping before the filter
    assert "shaped_scores" in next(s for s in spec.stages if s.kind == "filter").inputs


def test_ppo_trains_the_critic_on_returns_of_the_advantage_stage():
    spec = _build("ppo")
    adv = next(s for s in spec.stages if s.name == "advantages")
    assert adv.outputs == ["advantages", "returns"] and adv.batch_rows == 0  # gae whitens over the step
    assert "returns" in next(s for s in spec.stages if s.name == "critic_update").inputs
    assert "critic" in spec.roles


def test_remax_baseline_is_a_second_greedy_rollout():
    spec = _build("remax")
    base = next(s for s in spec.stages if s.name == "baseline")
    assert base.kind == "rollout" and base.outputs == ["baseline_ids"]
    assert base.options == {"temperature": 0.0, "one_per_group": True}
    assert "baseline_scores" in next(s for s in spec.stages if s.name == "advantages").inputs


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "remax"])
def test_an_inline_reward_is_scored_by_the_rollout_stage(name):
    """placement.reward_with=inline: no reward role or stage; the rollout stage reads what the
    rule reads and writes the scores (each rollout stage its own: ReMax's baseline too)."""
    spec = _build(name, "placement.reward_with=inline")
    assert "reward" not in spec.roles and all(s.role != "reward" for s in spec.stages)
    scored = {s.name: s for s in spec.stages if s.kind == "rollout"}
    want = {"rollout": "scores", "baseline": "baseline_scores"} if name == "remax" else {"rollout": "scores"}
    assert scored.keys() == want.keys()
    for stage_name, column in want.items():
        s = scored[stage_name]
        assert s.options["score_into"] == column and s.outputs[-1] == column
        assert {"answer", "prompt", "metadata"} <= set(s.inputs)
    assert _build(name, "placement.reward_with=rollout").roles["reward"].on == "rollout"


def test_an_inline_reward_model_is_refused():
    with pytest.raises(ConfigError, match="reward_with=inline"):
        load_config(find_recipe("grpo").config, ["placement.reward_with=inline", "reward.model_path=/m"])


def test_group_estimator_with_one_response_is_refused():
    with pytest.raises(ValueError, match="rollout.n=1 with algorithm.advantage=grpo") as e:
        _build("grpo", "rollout.n=1")
    assert "recipes/grpo/recipe.py" in str(e.value)
    _build("grpo", "rollout.n=1", "algorithm.advantage=reinforce_pp", "algorithm.dynamic_sampling=false")
    _build("remax", "rollout.n=1")  # its baseline is the greedy response, not the group


def test_an_algorithm_piece_registered_by_a_user_module_is_accepted(tmp_path, monkeypatch):
    (tmp_path / "my_estimators.py").write_text(
        "from asyncflow.algorithms import ADVANTAGES\n"
        "from asyncflow.algorithms.advantages import rloo\n"
        "ADVANTAGES.register('my_rloo')(rloo)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'my_rloo' is not registered"):
        load_config(overrides=["algorithm.advantage=my_rloo"])
    cfg = load_config(overrides=["algorithm.advantage=my_rloo", "imports=[my_estimators]"])
    assert cfg.algorithm.advantage == "my_rloo"
    with pytest.raises(ConfigError, match="imports: cannot import 'no_such_module'"):
        load_config(overrides=["imports=[no_such_module]"])


GOOD = """
from asyncflow.workflow.stages import DRIVER, RecipeSpec, Role, Stage
from recipes.grpo import recipe as grpo

def build(cfg):
    roles = grpo.roles(cfg)
    stages = [grpo.rollout(cfg), grpo.reward(cfg), grpo.advantage(cfg, ["scores", "response_ids"]), grpo.update(cfg)]
    {mutation}
    return RecipeSpec(roles, stages)
"""


def _recipe(tmp_path, mutation: str):
    # a package name of its own per test: an imported recipe stays in sys.modules
    d = tmp_path / ("r_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name))
    d.mkdir()
    (d / "recipe.py").write_text(textwrap.dedent(GOOD).replace("{mutation}", mutation))
    (d / "config.yaml").write_text("algorithm:\n  dynamic_sampling: false\n")
    return d


def test_a_recipe_in_any_directory_builds(tmp_path):
    spec = _build(_recipe(tmp_path, "pass"))
    assert [s.name for s in spec.stages] == ["rollout", "reward", "advantages", "update"]


@pytest.mark.parametrize("mutation, message", [
    ('roles["reward"] = Role("no_such_module:Nope", on="actor")', r"role 'reward'.*cannot import module"),
    ('roles["reward"] = Role("asyncflow.workers.reward:Nope", on="actor")', r"role 'reward'.*has no class 'Nope'"),
    ('stages.insert(2, Stage("shape", DRIVER, "", ["nobody_writes"], ["x"], fn=len))',
     r"stage 'shape' reads \['nobody_writes'\]"),
    ('stages.insert(2, Stage("again", DRIVER, "", ["scores"], ["scores"], fn=len))',
     r"stage 'again' writes column 'scores', which stage 'reward' already writes"),
    ('roles["reward"] = Role("asyncflow.workers.reward:RewardWorker", on=[])', r"role 'reward' has no ranks"),
    ('stages.insert(2, Stage("judge", "judge", "compute", ["scores"], ["y"]))',
     r"stage 'judge' runs on role 'judge', which the recipe does not declare"),
    ('stages[1] = Stage("reward", "reward", "no_such_method", ["response_ids"], ["scores"])',
     r"stage 'reward' calls 'no_such_method'"),
    ('roles["rollout"] = Role("asyncflow.workers.rollout:RolloutWorker", on="rollout")', r"per_rank=True"),
    ('roles["spare"] = Role("asyncflow.workers.reward:RewardWorker")', r"roles \['spare'\] are declared but"),
    ('stages.pop()', r"exactly one update stage"),
    ('stages.insert(2, Stage("f", DRIVER, "", ["scores"], ["ok"], kind="filter", fn=len))',
     r"stage 'advantages' comes after the filter 'f' but reads none of \['ok'\]"),
    ('stages.insert(1, Stage("bad", DRIVER, "", ["prompt_ids"], ["x"], kind="nonsense", fn=len))',
     r"stage 'bad': kind must be one of"),
    ('stages.insert(1, Stage("m", DRIVER, "", ["response_ids"], ["loss_mask"], fn=len))',
     r"stage 'advantages' must read 'loss_mask'"),
    ('stages[0] = grpo.rollout(cfg, options={"episode": "no_such_episodes:run"})',
     r"stage 'rollout': episode 'no_such_episodes:run': cannot load it"),
])
def test_a_wrong_declaration_fails_at_start_naming_the_recipe(tmp_path, mutation, message):
    d = _recipe(tmp_path, mutation)
    with pytest.raises((ValueError, TypeError)) as e:
        _build(d)
    assert str(d / "recipe.py") in str(e.value)
    assert __import__("re").search(message, str(e.value)), str(e.value)


def test_build_must_return_a_recipe_spec(tmp_path):
    d = _recipe(tmp_path, "return stages")
    with pytest.raises(TypeError, match="must return a RecipeSpec"):
        _build(d)


def test_a_driver_stage_needs_a_function_and_a_filter_runs_in_the_driver():
    from asyncflow.workflow.stages import Stage
    with pytest.raises(ValueError, match="driver stage needs a function"):
        Stage("f", "driver", "", ["scores"], ["x"])
    with pytest.raises(ValueError, match="filter stage runs in the driver"):
        Stage("f", "reward", "compute", ["scores"], ["x"], kind="filter")


def test_the_launcher_refuses_a_wrong_recipe_before_starting_processes(tmp_path):
    from asyncflow.launcher import prepare
    d = _recipe(tmp_path, 'stages.insert(2, Stage("shape", DRIVER, "", ["nobody_writes"], ["x"], fn=len))')
    with pytest.raises(ConfigError, match="nobody_writes"):
        prepare([str(d), f"trainer.out_dir={tmp_path / 'out'}"])


def test_the_train_command_s_help_names_every_built_in_recipe(capsys):
    from asyncflow.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    root = Path(__file__).resolve().parents[2]
    names = sorted(p.parent.name for p in (root / "recipes").glob("*/recipe.py"))
    assert names and f"({', '.join(names)})" in help_text, help_text
