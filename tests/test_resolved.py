"""The run's config resolved once: the launcher derives every value, the driver gets the object
as it is, the workers its wire form back without any check or resolution again."""
from __future__ import annotations

import json
import pickle

import pytest

import asyncflow.config.loading as loading
from asyncflow.config import load_config
from asyncflow.resolved import DerivedValues, ResolvedRun, resolve_run
from asyncflow.workers.common import config_of, resolved_of, setup_rank
from asyncflow.workflow.stages import RecipeSpec


def test_resolve_run_derives_every_value_once():
    cfg = load_config(None, ["workflow.mode=sync", "placement.mode=colocated", "trainer.threads=0"])
    run = resolve_run(cfg, "cuda", cpus=8)
    assert run.derived == DerivedValues(platform="cuda", offload_idle=True, rollout_dtype="bfloat16",
                                        rank_threads=4, policy_loss="ppo_clip")
    run = resolve_run(load_config(None, ["workflow.mode=async"]), "cpu", cpus=8)
    assert (run.derived.offload_idle, run.derived.rollout_dtype, run.derived.policy_loss) == \
        (False, "float32", "decoupled_ppo")
    with pytest.raises(AttributeError):
        run.derived = run.derived  # type: ignore[misc]  # frozen


def test_the_wire_form_is_json_and_comes_back_unchecked(monkeypatch):
    run = resolve_run(load_config(None, ["trainer.steps=3"]), "cpu", cpus=4)
    wire = json.loads(json.dumps(run.to_wire()))  # what a worker call carries
    def no_check(cfg):
        raise AssertionError("a worker must not check the config again")
    monkeypatch.setattr(loading, "check", no_check)
    back = ResolvedRun.from_wire(wire)
    assert back == run and back.config.trainer.steps == 3


def test_a_worker_reads_the_derived_values_it_is_sent_not_its_own(monkeypatch):
    """The values in the wire form win, even where this process would derive others."""
    run = resolve_run(load_config(None, []), "cpu", cpus=4)
    odd = ResolvedRun(run.config, DerivedValues("cpu", True, "bfloat16", 7, "gspo"))
    got = resolved_of(odd.to_wire(), "cpu")
    assert got.derived == odd.derived
    assert config_of(odd.to_wire()) == run.config  # a custom worker's view: the config tree
    set_to = []
    monkeypatch.setattr("asyncflow.workers.common.set_threads", set_to.append)
    setup_rank(got)
    assert set_to == [7]


def test_a_worker_built_by_hand_with_a_plain_config_derives_its_values():
    from asyncflow.config import to_dict
    cfg = load_config(None, ["placement.mode=colocated", "workflow.mode=sync"])
    got = resolved_of(to_dict(cfg), "cpu")
    assert got.config == cfg and got.derived.offload_idle and got.derived.rollout_dtype == "float32"


def test_the_launcher_hands_the_driver_the_resolved_run(tmp_path, monkeypatch):
    """train_main resolves once and passes the object to the driver's main (pickled into the
    spawned rank with the launch config); no environment variable, no reload."""
    from asyncflow import launcher
    from asyncflow.launcher import train_main
    seen = []
    monkeypatch.setattr(launcher, "launch_local", lambda cfg, nproc, **kw: seen.append(cfg) or 0)
    assert train_main(["grpo", f"trainer.out_dir={tmp_path}", "trainer.platform=cpu", "workflow.mode=sync"]) == 0
    (lc,) = seen
    assert lc.main == "asyncflow.training.trainer:driver_main"
    run, spec = lc.main_args
    assert isinstance(run, ResolvedRun) and run.derived.platform == "cpu" and run.derived.policy_loss == "ppo_clip"
    assert run.config.model.path  # the tiny model, resolved by the launcher
    # the built recipe goes too, as it is: the driver builds nothing again
    assert isinstance(spec, RecipeSpec) and [s.name for s in spec.stages][-1] == "update"
    back = pickle.loads(pickle.dumps(lc)).main_args
    assert back[0] == run and [s.name for s in back[1].stages] == [s.name for s in spec.stages]
    assert (tmp_path / "run_config.yaml").is_file()  # still written, for people


def test_the_driver_refuses_to_start_without_a_resolved_run():
    import asyncio

    from asyncflow.training.trainer import driver_main
    with pytest.raises(RuntimeError, match="asyncflow train"):
        asyncio.run(driver_main(object()))


def test_a_built_recipe_that_does_not_pickle_is_built_again_by_the_driver(caplog):
    """A driver stage of a lambda cannot cross to the spawned rank 0: the launcher hands on
    None, says why, and the driver builds the recipe from the same resolved config."""
    from asyncflow.launcher import spec_to_hand_on
    from asyncflow.workflow.stages import DRIVER, Stage
    spec = RecipeSpec(roles={}, stages=[Stage("shape", DRIVER, "", ["scores"], ["x"], fn=lambda b: b)])
    with caplog.at_level("INFO", logger="asyncflow.launcher"):
        assert spec_to_hand_on(spec, "mine") is None
    assert "recipe mine: its built stages do not pickle" in caplog.text
