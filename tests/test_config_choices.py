"""The config's fixed-choice settings (workflow.mode, rollout.engine, ...): plain strings checked
when the config loads, not Literal annotations, so that the config loads on omegaconf 2.3 (the
newest that hydra-core 1.3, and so verl, installs beside) as well as 2.4. CI's second run
(requirements-lowest.txt) runs this file on omegaconf 2.3.0."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from asyncflow.config import ConfigError, RunConfig, load_config


def _choice_fields(section=None, prefix=""):
    """(dotted key, choices, default) of every one_of setting, nested sections included."""
    section = RunConfig() if section is None else section
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "choices" in f.metadata:
            out.append((prefix + f.name, tuple(f.metadata["choices"]), value))
        elif dataclasses.is_dataclass(value):
            out += _choice_fields(value, f"{prefix}{f.name}.")
    return out


CHOICES = _choice_fields()


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_choice_settings_are_found():
    keys = {k for k, _, _ in CHOICES}
    assert {"workflow.mode", "placement.mode", "placement.reward_with", "placement.ref_with", "rollout.engine",
            "model.train_engine", "trainer.platform", "transfer_queue.storage_units", "weight_sync.dtype",
            "rollout.length_profile", "data.task", "reward.on_error"} <= keys, sorted(keys)


def test_no_config_field_is_a_literal():
    """omegaconf 2.3 refuses Literal annotations ('Unexpected type annotation: Literal[...]')."""
    def walk(cls, prefix=""):
        for name, hint in typing.get_type_hints(cls).items():
            assert typing.get_origin(hint) is not typing.Literal, f"{prefix}{name}: {hint}"
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")
    walk(RunConfig)


@pytest.mark.parametrize("key, choices, default", CHOICES, ids=[k for k, _, _ in CHOICES])
def test_every_choice_loads_as_a_plain_str_and_a_wrong_one_names_the_key_and_choices(key, choices, default):
    assert default in choices
    for choice in choices:
        if key == "data.task" and choice == "file":
            continue  # needs data.path (its own check)
        value = _get(load_config(None, [f"{key}={choice or repr('')}"]), key)  # key='' (key= is null)
        assert type(value) is str and value == choice  # code compares cfg.workflow.mode == "async"
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=no_such_choice"])
    assert str(e.value) == (f"config key '{key}': Invalid value 'no_such_choice', "
                            f"expected one of {list(choices)}")


def test_choices_from_a_yaml_file_and_a_bad_one_there(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("workflow:\n  mode: sync\nplacement:\n  mode: colocated\n  ref_with: rollout\n")
    cfg = load_config(good, ["rollout.engine=builtin"])
    assert (cfg.workflow.mode, cfg.placement.mode, cfg.placement.ref_with) == ("sync", "colocated", "rollout")
    bad = tmp_path / "bad.yaml"
    bad.write_text("weight_sync:\n  dtype: float64\n")
    with pytest.raises(ConfigError, match=r"'weight_sync.dtype': Invalid value 'float64', expected one of "
                                          r"\['auto', 'float32', 'bfloat16', 'float16'\]"):
        load_config(bad)


def test_a_later_layer_mends_an_earlier_wrong_choice(tmp_path):
    """The check reads the merged config: an override wins over the yaml, as for every key."""
    y = tmp_path / "c.yaml"
    y.write_text("workflow:\n  mode: fast\n")
    assert load_config(y, ["workflow.mode=stream"]).workflow.mode == "stream"


def test_a_non_string_value_is_refused_too():
    with pytest.raises(ConfigError, match="'trainer.platform': Invalid value '1'"):
        load_config(None, ["trainer.platform=1"])
