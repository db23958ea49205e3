"""The launch scripts in scripts/: placement.py's rank lists, `bash -n`, and each launch
script's torchrun command line (run with TORCHRUN=echo) accepted by load_config.

Fast: no process beyond bash and placement.py starts, nothing is trained.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.workflow.recipe import find_recipe

REPO = Path(__file__).resolve().parents[1]
PLACEMENT = REPO / "scripts" / "npu" / "placement.py"
SHELL_SCRIPTS = sorted(REPO.glob("scripts/**/*.sh"))
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")

# script -> (platform, ranks per node, train engine, workflow mode, placement mode)
LAUNCH = {
    "scripts/npu/grpo_qwen2.5_7b.sh": ("npu", 16, "mindspeed", "async", "disaggregated"),
    "scripts/npu/grpo_qwen2.5_32b.sh": ("npu", 16, "mindspeed", "async", "disaggregated"),
    "scripts/npu/grpo_qwen2.5_7b_sync_baseline.sh": ("npu", 16, "mindspeed", "sync", "colocated"),
    "scripts/gpu/grpo_qwen2.5_7b.sh": ("cuda", 8, "fsdp", "async", "disaggregated"),
}


def _placement_module():
    spec = importlib.util.spec_from_file_location("asyncflow_scripts_placement", PLACEMENT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_placement(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLACEMENT), *args], capture_output=True, text=True, timeout=60)


def parse_ranks(line: str, key: str) -> list[int]:
    name, _, value = line.partition("=")
    assert name == key, line
    assert " " not in line, "each override must be one shell word"
    assert value.startswith("[") and value.endswith("]"), line
    return [int(x) for x in value[1:-1].split(",") if x]


# ---------------------------------------------------------------- placement.py

@pytest.mark.parametrize("nnodes", [2, 4, 16, 64])
def test_placement_whole_nodes_and_config(nnodes):
    per_node = 16
    p = run_placement("--nnodes", str(nnodes), "--per-node", str(per_node), "--rollout-share", "2/3")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout
    actor = parse_ranks(lines[0], "placement.actor_ranks")
    rollout = parse_ranks(lines[1], "placement.rollout_ranks")
    total = nnodes * per_node
    assert actor and rollout
    assert not set(actor) & set(rollout)
    assert sorted(actor + rollout) == list(range(total))
    assert 0 in actor  # rank 0 (driver, TransferQueue) trains, as in the default config
    for node in range(nnodes):  # whole nodes per role
        ranks = set(range(node * per_node, (node + 1) * per_node))
        assert ranks <= set(actor) or ranks <= set(rollout), f"node {node} is split between roles"
    # the nearest whole-node split to 2/3 rollout, never all nodes to one role
    expected_nodes = min(max(int(Fraction(2, 3) * nnodes + Fraction(1, 2)), 1), nnodes - 1)
    assert len(rollout) == expected_nodes * per_node
    assert "rollout share" in p.stderr
    cfg = load_config(None, [*lines, f"trainer.nproc={total}", "trainer.platform=npu"])
    assert cfg.placement.actor_ranks == actor and cfg.placement.rollout_ranks == rollout
    assert cfg.placement.mode == "disaggregated"


def test_placement_one_node_splits_ranks():
    p = run_placement("--nnodes", "1", "--per-node", "8")
    assert p.returncode == 0, p.stderr
    actor = parse_ranks(p.stdout.splitlines()[0], "placement.actor_ranks")
    rollout = parse_ranks(p.stdout.splitlines()[1], "placement.rollout_ranks")
    assert (actor, rollout) == ([0, 1, 2], [3, 4, 5, 6, 7])  # round(8 * 2/3) = 5 rollout ranks
    load_config(None, [*p.stdout.splitlines(), "trainer.nproc=8", "trainer.platform=cuda"])


def test_split_function():
    split = _placement_module().split
    assert split(2, 4, Fraction(1, 2)) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split(2, 4, Fraction(1, 2), "rank") == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split(2, 4, Fraction(2, 3), "rank") == ([0, 1, 2], [3, 4, 5, 6, 7])  # round(16/3) = 5
    assert split(4, 2, Fraction(9, 10)) == ([0, 1], [2, 3, 4, 5, 6, 7])  # at least one training node
    assert split(4, 2, Fraction(1, 100)) == ([0, 1, 2, 3, 4, 5], [6, 7])  # at least one rollout node
    assert split(1, 2, Fraction(1, 100)) == ([0], [1])
    assert split(1, 2, Fraction(99, 100)) == ([0], [1])
    for fraction in ("0.5", "1/2", " 1/2 "):
        assert _placement_module()._share(fraction) == Fraction(1, 2)
    with pytest.raises(ValueError, match="at least 2"):
        split(1, 1, Fraction(1, 2))


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "0"], "--nnodes: must be >= 1, got 0"),
    (["--nnodes", "-2"], "--nnodes: must be >= 1"),
    (["--nnodes", "four"], "--nnodes: 'four' is not an integer"),
    (["--nnodes", "2", "--per-node", "0"], "--per-node: must be >= 1"),
    (["--nnodes", "2", "--rollout-share", "0"], "must lie strictly between 0 and 1"),
    (["--nnodes", "2", "--rollout-share", "1"], "must lie strictly between 0 and 1"),
    (["--nnodes", "2", "--rollout-share", "1.5"], "must lie strictly between 0 and 1"),
    (["--nnodes", "2", "--rollout-share", "most"], "'most' is not a number or fraction"),
    (["--nnodes", "2", "--rollout-share", "1/0"], "'1/0' is not a number or fraction"),
    (["--nnodes", "1", "--per-node", "1"], "needs at least 2 (one training, one rollout)"),
    (["--per-node", "8"], "the following arguments are required: --nnodes"),
    (["--nnodes", "2", "--granularity", "rack"], "invalid choice: 'rack'"),
])
def test_placement_bad_inputs(args, message):
    p = run_placement(*args)
    assert p.returncode == 2
    assert p.stdout == ""
    assert "placement.py: error:" in p.stderr and message in p.stderr, p.stderr


# ---------------------------------------------------------------- shell scripts

def test_every_launch_script_is_here():
    names = {str(p.relative_to(REPO)) for p in SHELL_SCRIPTS}
    assert set(LAUNCH) <= names
    assert "scripts/device_check.sh" in names


@needs_bash
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(script):
    p = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    head = script.read_text().splitlines()[:40]
    assert head[0] == "#!/usr/bin/env bash"
    assert any("set -euo pipefail" in line for line in script.read_text().splitlines())
    if str(script.relative_to(REPO)) in LAUNCH:
        assert any("NOT RUN ON HARDWARE" in line for line in head), "say in the header that it has not been run"


LAUNCH_ENV = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "MODEL_PATH", "DATA_PATH",
              "EVAL_PATH", "OUT_DIR", "ROLLOUT_SHARE", "ASCEND_HOME_PATH", "PROMPTS_PER_STEP", "STEPS")


def echo_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run a launch script with TORCHRUN=echo: it prints its command line instead of starting it."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    full = {**base, "TORCHRUN": "echo", "PYTHON": sys.executable, "ASCEND_ENV": "/nonexistent/set_env.sh", **env}
    return subprocess.run([BASH, str(REPO / script), *args], capture_output=True, text=True, timeout=60,
                          env=full, cwd=REPO)


def parse_command(stdout: str) -> tuple[dict[str, str], list[str]]:
    """(torchrun flags, asyncflow overrides) of the echoed command line."""
    words = stdout.split()
    i = words.index("-m")
    assert words[i + 1:i + 4] == ["asyncflow.cli", "train", "grpo"], stdout[:300]
    flags = dict(zip(words[:i:2], words[1:i:2]))
    overrides = words[i + 4:]
    assert all("=" in w for w in overrides), [w for w in overrides if "=" not in w]
    return flags, overrides


@needs_bash
@pytest.mark.parametrize("script", sorted(LAUNCH))
@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_launch_command_line(script, nnodes):
    platform, per_node, engine, mode, place = LAUNCH[script]
    p = echo_script(script, NNODES=str(nnodes), NODE_RANK=str(nnodes - 1), MASTER_ADDR="10.0.0.1",
                    MASTER_PORT="29600", MODEL_PATH="/models/qwen", DATA_PATH="/data/dsr.jsonl", OUT_DIR="/shared/out")
    assert p.returncode == 0, p.stderr
    flags, overrides = parse_command(p.stdout)
    assert flags == {"--nnodes": str(nnodes), "--node-rank": str(nnodes - 1), "--nproc-per-node": str(per_node),
                     "--master-addr": "10.0.0.1", "--master-port": "29600"}
    total = nnodes * per_node
    keys = [o.split("=", 1)[0] for o in overrides]
    assert len(keys) == len(set(keys)), "an override appears twice"
    for key in ("trainer.platform", "trainer.nproc", "model.path", "data.task", "data.path", "reward.name",
                "rollout.engine", "model.train_engine", "workflow.mode", "placement.mode", "trainer.time_budget_s"):
        assert key in keys, key
    cfg = load_config(find_recipe("grpo").config, overrides)  # what `asyncflow train` checks at start
    assert cfg.trainer.platform == platform and cfg.trainer.nproc == total
    assert cfg.model.path == "/models/qwen" and cfg.model.train_engine == engine
    assert cfg.data.task == "file" and cfg.data.path == "/data/dsr.jsonl"
    assert cfg.reward.name == "math" and cfg.rollout.engine == "vllm"
    assert cfg.workflow.mode == mode and cfg.placement.mode == place
    assert cfg.trainer.time_budget_s == 0 and cfg.trainer.out_dir == "/shared/out"
    if place == "disaggregated":
        actor, rollout = cfg.placement.actor_ranks, cfg.placement.rollout_ranks
        assert sorted(actor + rollout) == list(range(total)) and not set(actor) & set(rollout)
        if nnodes >= 2:
            assert len(actor) % per_node == 0 and len(rollout) % per_node == 0  # whole nodes
    else:
        assert "placement.actor_ranks" not in keys and "placement.rollout_ranks" not in keys


@needs_bash
def test_launch_extra_arguments_are_overrides():
    p = echo_script("scripts/npu/grpo_qwen2.5_7b.sh", "trainer.steps=3", "rollout.n=4", NNODES="2")
    assert p.returncode == 0, p.stderr
    _, overrides = parse_command(p.stdout)
    assert overrides[-2:] == ["trainer.steps=3", "rollout.n=4"]
    cfg = load_config(find_recipe("grpo").config, overrides)  # later overrides win
    assert cfg.trainer.steps == 3 and cfg.rollout.n == 4
    bad = load_config_error([*overrides, "trainer.no_such_key=1"])
    assert "no_such_key" in bad


def load_config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(find_recipe("grpo").config, overrides)
    return str(e.value)


@needs_bash
@pytest.mark.parametrize("env, message", [
    ({"NNODES": "0"}, "NNODES must be a positive integer"),
    ({"NNODES": "two"}, "NNODES must be a positive integer"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK must be an integer in 0..1"),
    ({"NPROC_PER_NODE": "x"}, "NPROC_PER_NODE must be a positive integer"),
    ({"NNODES": "2", "ROLLOUT_SHARE": "1"}, "placement.py: error:"),
])
def test_launch_bad_environment(env, message):
    p = echo_script("scripts/npu/grpo_qwen2.5_7b.sh", **env)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert message in p.stderr and "asyncflow.cli" not in p.stdout, p.stderr
