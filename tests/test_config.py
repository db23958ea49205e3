"""Config: recipe yaml + key=value overrides, typed; wrong keys and values fail with their path."""
from __future__ import annotations

import os

import pytest

from asyncflow.config import ConfigError, load_config, offload_idle
from asyncflow.launcher import parse_train_args
from asyncflow.workflow.recipe import find_recipe


def test_defaults_are_the_main_job():
    cfg = load_config()
    assert (cfg.recipe, cfg.workflow.mode, cfg.placement.mode, cfg.trainer.nproc) == ("grpo", "async",
                                                                                      "disaggregated", 2)


def test_overrides_are_typed():
    cfg = load_config(find_recipe("grpo").config, ["workflow.mode=sync", "trainer.steps=7", "rollout.top_p=0.9"])
    assert cfg.workflow.mode == "sync" and cfg.trainer.steps == 7 and cfg.rollout.top_p == 0.9


@pytest.mark.parametrize("override, words", [
    ("trainer.no_such_key=1", ["trainer.no_such_key"]),
    ("trainer.steps=many", ["trainer.steps"]),
    ("workflow.mode=fast", ["workflow.mode", "sync"]),
    ("placement.rollout_ranks=[0]", ["ranks [0]", "colocated"]),
    ("rollout.engine=tgi", ["rollout.engine"]),
    ("placement.ref_with=gpu", ["placement.ref_with", "['actor', 'rollout']"]),
    ("optim.micro_batch_overhead_tokens=-7", ["optim: ", "micro_batch_overhead_tokens", "-1"]),
    ("critic_optim.lr=0", ["critic_optim: ", "lr must be > 0"]),
    ("data.task=file", ["data.path"]),
    ("justaword", ["key=value"]),
    ("transfer_queue.storage_units=per_rank", ["transfer_queue.storage_units", "per_node"]),
    ("transfer_queue.max_rows_per_unit=-1", ["transfer_queue.max_rows_per_unit", "0: unbounded"]),
    ("placement.offload_idle=sometimes", ["placement.offload_idle", "auto, on or off"]),
])
def test_bad_config_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_train_args():
    assert parse_train_args([]) == ("grpo", [])
    assert parse_train_args(["ppo", "a.b=1"]) == ("ppo", ["a.b=1"])
    assert parse_train_args(["a.b=1"]) == ("grpo", ["a.b=1"])
    with pytest.raises(ConfigError):
        parse_train_args(["grpo", "stray"])


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="grpo"):
        find_recipe("nope")


@pytest.mark.parametrize("overrides, expected", [
    (["placement.mode=colocated", "workflow.mode=sync"], True),  # auto: roles switch once per stage
    (["placement.mode=colocated", "workflow.mode=async"], False),  # auto: they switch per micro-batch
    (["placement.mode=colocated", "workflow.mode=stream"], False),
    (["placement.mode=colocated", "workflow.mode=async", "placement.offload_idle=on"], True),
    (["placement.mode=colocated", "workflow.mode=sync", "placement.offload_idle=off"], False),
    (["placement.mode=colocated", "workflow.mode=async", "placement.offload_idle=true"], True),
    (["placement.mode=disaggregated", "workflow.mode=sync", "placement.offload_idle=on"], False),
])
def test_offload_idle_resolves_by_placement_and_mode(overrides, expected):
    assert offload_idle(load_config(None, overrides)) is expected


def test_rank_threads_share_the_cores_when_ranks_overlap(monkeypatch):
    from asyncflow.config import load_config, rank_threads
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert rank_threads(load_config(overrides=["workflow.mode=async"]), cpus=8) == 4  # 2 ranks share 8 cores
    assert rank_threads(load_config(overrides=["workflow.mode=stream", "trainer.nproc=3",
                                               "placement.rollout_ranks=[1,2]"]), cpus=2) == 1
    assert rank_threads(load_config(overrides=["workflow.mode=sync"]), cpus=8) == 0  # turns: every core
    assert rank_threads(load_config(overrides=["workflow.mode=sync", "placement.mode=colocated"]), cpus=8) == 4
    assert rank_threads(load_config(overrides=["workflow.mode=async", "trainer.threads=3"]), cpus=8) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # under torchrun: the ranks of this node
    assert rank_threads(load_config(overrides=["workflow.mode=async"]), cpus=16) == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity API on this OS")
def test_rank_threads_count_the_cores_this_process_may_use(monkeypatch):
    """Under taskset or a cgroup cpuset the host's core count would oversubscribe the allowed cores."""
    from asyncflow.config import load_config, rank_threads, usable_cpus
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert usable_cpus() == 2
    assert rank_threads(load_config(overrides=["workflow.mode=async"])) == 1


VLLM3 = ["rollout.engine=vllm", "trainer.nproc=3", "placement.actor_ranks=[0]", "placement.rollout_ranks=[1,2]"]


def test_rollout_devices_give_each_vllm_instance_its_own_devices():
    from asyncflow.config import rollout_devices
    cfg = load_config(overrides=[*VLLM3, "placement.rollout_devices=[[1,2],[3,4]]"])
    assert rollout_devices(cfg, 1) == [1, 2] and rollout_devices(cfg, 2) == [3, 4]
    assert rollout_devices(cfg, 0) is None  # the actor's rank
    assert rollout_devices(load_config(overrides=VLLM3), 1) is None  # unset: the rank's own device


@pytest.mark.parametrize("devices", ["[[1,2]]", "[[1,2],[2,3]]", "[[1],[]]", "[[-1],[2]]"])
def test_bad_rollout_devices_are_refused_saying_what_fits(devices):
    with pytest.raises(ConfigError, match="placement.rollout_devices: .* one non-empty list .* per rollout rank"):
        load_config(overrides=[*VLLM3, f"placement.rollout_devices={devices}"])


def test_rollout_devices_need_vllm():
    with pytest.raises(ConfigError, match="rollout.engine=vllm"):
        load_config(overrides=[*VLLM3[1:], "placement.rollout_devices=[[1],[2]]"])


def test_weight_sync_settings_are_checked():
    with pytest.raises(ConfigError, match="weight_sync.bucket_mb"):
        load_config(overrides=["weight_sync.bucket_mb=0"])
    with pytest.raises(ConfigError, match="weight_sync"):
        load_config(overrides=["weight_sync.load=copy"])


@pytest.mark.parametrize("override, key", [
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"), ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.top_p=0", "rollout.top_p"), ("rollout.top_p=2", "rollout.top_p"), ("rollout.top_k=-1", "rollout.top_k"),
    ("rollout.gpu_memory_utilization=3", "rollout.gpu_memory_utilization")])
def test_sampling_values_the_engines_refuse_are_config_errors_at_load(override, key):
    """Refused when the config loads, naming the key, not by a rollout rank once the run started."""
    with pytest.raises(ConfigError, match=f"{key}: must"):
        load_config(None, [override])
    load_config(None, ["rollout.temperature=0", "rollout.top_p=1", "rollout.top_k=0"])  # the edges are fine


@pytest.mark.parametrize("override, key", [
    ("trainer.steps=-1", "trainer.steps"), ("trainer.time_budget_s=-1", "trainer.time_budget_s"),
    ("trainer.eval_every=-1", "trainer.eval_every"), ("trainer.threads=-1", "trainer.threads"),
    ("workflow.call_timeout_s=0", "workflow.call_timeout_s"), ("reward.timeout_s=0", "reward.timeout_s"),
    ("data.num_eval=0", "data.num_eval"), ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),
    ("warmup.lr=0", "warmup.lr"), ("warmup.max_steps=-1", "warmup.max_steps"),
    ("warmup.batch_size=0", "warmup.batch_size"), ("warmup.check_every=0", "warmup.check_every"),
    ("warmup.target_accuracy=2", "warmup.target_accuracy"), ("algorithm.kl_coef=-1", "algorithm.kl_coef"),
    ("optim.weight_decay=-1", "weight_decay"), ("optim.betas=[0.9,1.5]", "betas")])
def test_out_of_range_run_settings_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_each_section_checks_its_own_values_and_check_gathers_them():
    """A section's validate() lists its own problems (no other section needed); the loader's
    check() reports every section's and the cross-section rules together."""
    from asyncflow.config import RunConfig, TrainerConfig, WorkflowConfig, check
    assert TrainerConfig().validate() == [] and WorkflowConfig().validate() == []
    assert TrainerConfig(nproc=0).validate() == ["trainer.nproc: must be >= 1, got 0"]
    assert WorkflowConfig(max_staleness=-1).validate() == ["workflow.max_staleness: must be >= 0, got -1"]
    cfg = RunConfig()
    cfg.trainer.nproc, cfg.workflow.max_staleness = 0, -1
    cfg.placement.actor_ranks = [5]  # a cross-section rule: ranks within trainer.nproc (here not checked: nproc < 2)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert "trainer.nproc: must be >= 1" in str(e.value) and "workflow.max_staleness: must be >= 0" in str(e.value)
