"""`asyncflow train`: from a recipe and key=value overrides to running ranks.

On a laptop it starts ``trainer.nproc`` local ranks itself through torch's elastic
launcher; under ``torchrun`` (RANK is set) each rank joins the run directly:

    asyncflow train                                  # the default: GRPO, async, 2 CPU ranks
    asyncflow train grpo workflow.mode=sync trainer.nproc=2
    torchrun --nproc-per-node 2 -m asyncflow.cli train grpo
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from .config import ConfigError, RunConfig, load_config
from .data.dataset import DataError
from .data.run_data import prompt_room
from .engines.rollout.vllm_args import probe, problems
from .engines.rollout.vllm_lora import vllm_lora_problems
from .engines.train.lora import LoraOptions, model_dir_problems
from .models.loading import ModelLoadError, check_model_dir
from .platform import get_platform
from .resolved import ResolvedRun, resolve_run
from .rewards.custom import CustomRewardError, check_file_reward
from .single_controller.driver import DriverConfig
from .single_controller.launch import LaunchConfig, launch_local, ranks_sharing_devices, run_from_env
from .single_controller.supervise import launch_supervised, under_elastic_agent_problem
from .training.trainer import resolve_model, source_columns
from .workflow.checkpoints import complete
from .workflow.recipe import find_recipe
from .workflow.stages import RecipeSpec

log = logging.getLogger(__name__)


def parse_train_args(argv: Sequence[str]) -> tuple[str, list[str]]:
    recipe, overrides = "grpo", []
    for i, a in enumerate(argv):
        if i == 0 and "=" not in a:
            recipe = a
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(f"argument {a!r}: expected key=value after the recipe name (e.g. trainer.steps=10)")
    return recipe, overrides


def prepare(argv: Sequence[str]) -> tuple[RunConfig, Path, RecipeSpec]:
    """Load and check the config, build the tiny model once (``model.path``), build the recipe
    from that config (a wrong one fails here, before any process starts), write the config the
    run will use (``run_config.yaml``, for people: the driver receives the resolved run and the
    built recipe themselves, see ``train_main``)."""
    name, overrides = parse_train_args(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun the world is torchrun's
        overrides = [*overrides, f"trainer.nproc={int(os.environ['WORLD_SIZE'])}"]
    recipe = find_recipe(name)
    cfg = load_config(recipe.config, [*overrides, f"recipe={recipe.directory}"])
    cfg.model.path = resolve_model(cfg)
    try:  # a wrong recipe fails here, before any process starts
        spec = recipe.build(cfg, source_columns(cfg))
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError(str(e)) from e
    rank0 = int(os.environ.get("RANK", "0")) == 0  # this process starts the ranks, or is rank 0 under torchrun
    check_paths(cfg, driver_node=rank0, every_role_here="RANK" not in os.environ)
    idle = idle_ranks(cfg)
    if idle and rank0:
        p = cfg.placement
        log.warning("ranks %s hold no role and will idle (trainer.nproc=%d, placement.actor_ranks=%s, "
                    "placement.rollout_ranks=%s): lower trainer.nproc or give them roles", idle, cfg.trainer.nproc,
                    list(p.actor_ranks), list(p.rollout_ranks))
    out = Path(cfg.trainer.out_dir)
    path = out / "run_config.yaml"
    try:
        out.mkdir(parents=True, exist_ok=True)
        if rank0:
            path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            (out / "ranks.json").unlink(missing_ok=True)  # an earlier run's: written anew once the groups exist
    except OSError as e:
        raise ConfigError(f"trainer.out_dir={out}: the run cannot write there ({e.strerror or e}: "
                          f"{e.filename or out}); give a directory this user can create and write") from e
    return cfg, path, spec


def spec_to_hand_on(spec: RecipeSpec, recipe: str) -> RecipeSpec | None:
    """The built recipe as the driver will take it, or None where it does not pickle (a driver
    stage of a closure or a lambda: rank 0 is a spawned process): the driver then builds the
    recipe again from the same resolved config, and the log says so."""
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        log.info("recipe %s: its built stages do not pickle (%s); the driver builds the recipe again from the "
                 "same config (module-level functions or functools.partial make it pickle)", recipe, e)
        return None
    return spec


def idle_ranks(cfg: RunConfig) -> list[int]:
    """Ranks a disaggregated placement gives no role, rank 0 aside (it drives the run and serves
    the TransferQueue, so a placement may leave it free on purpose)."""
    if cfg.placement.mode != "disaggregated":
        return []
    used = {0, *cfg.placement.actor_ranks, *cfg.placement.rollout_ranks}
    return [r for r in range(cfg.trainer.nproc) if r not in used]


def check_paths(cfg: RunConfig, *, driver_node: bool = True, every_role_here: bool = True) -> None:
    """The run's local files, checked before any rank starts, so that a typo in a path fails in a
    second with the key to fix rather than from inside a worker. Every node loads ``model.path``;
    the driver's node reads the prompt files; model.lora's targets and rank must fit the model's
    layers; the reward model and a reward file (imported, its
    function looked up) are checked where every role runs on this node (a local launch), since
    under torchrun their node depends on the placement. A
    generation budget that fills the model's context is refused here too, and a stop file
    (``trainer.stop_file``) that exists already."""

    checks = [("model.path", cfg.model.path, False)]
    if cfg.reward.model_path and every_role_here:
        checks.append(("reward.model_path", cfg.reward.model_path, True))
    for key, path, reward_model in checks:
        try:
            check_model_dir(path, reward_model=reward_model)
        except ModelLoadError as e:
            raise ConfigError(f"{key}={path}: {e}") from e
    if cfg.reward.custom_path and every_role_here:  # like the reward model: its node depends on the placement
        try:
            check_file_reward(cfg.reward.custom_path, cfg.reward.custom_name)
        except CustomRewardError as e:
            raise ConfigError(f"reward.custom_path={cfg.reward.custom_path}: {e}") from e
    try:
        prompt_room(cfg, cfg.model.path)
    except DataError as e:
        raise ConfigError(str(e)) from e
    if cfg.model.lora.rank is not None:  # the targets and the rank against the model's layers
        lora = LoraOptions.from_model_config(cfg.model)  # None only when the rank is
        found = model_dir_problems(cfg.model.path, lora) if lora is not None else []
        if found:
            raise ConfigError(f"model.lora (model.path={cfg.model.path}):\n  " + "\n  ".join(found))
    stop = cfg.trainer.stop_path()
    if stop is not None and driver_node and stop.exists():  # it would end RL at its first step
        raise ConfigError(f"trainer.stop_file={cfg.trainer.stop_file}: {stop} exists already (left by an earlier "
                          "stop?); remove it to run, or name another file")
    if cfg.data.task == "file" and driver_node:
        for key in ("data.path", "data.eval_path"):
            path = getattr(cfg.data, key.split(".")[1])
            if path and not Path(path).expanduser().is_file():
                what = "is a directory" if Path(path).expanduser().is_dir() else "does not exist"
                raise ConfigError(f"{key}={path}: {what}; expected a .jsonl or .parquet file of prompts and "
                                  "answers (docs/configuration.md, section data)")


def check_vllm(run: ResolvedRun) -> None:
    """rollout.engine=vllm: the installed vLLM takes the run's engine arguments, serves the
    model's architecture, runs on the run's platform and, where the placement must free the
    instance's memory (``offload_idle``), can sleep. Imports vLLM (seconds), once, before any
    rank starts."""


    cfg, platform, offload_idle = run.config, run.derived.platform, run.derived.offload_idle
    facts = probe()
    cfg_json = Path(cfg.model.path).expanduser() / "config.json"
    archs = list(json.loads(cfg_json.read_text()).get("architectures") or [])
    found = problems(dict(cfg.rollout.engine_kwargs), facts, platform=platform, architectures=archs,
                     want_sleep=offload_idle,
                     forced_sleep=str(cfg.placement.offload_idle).lower() in ("on", "true"))
    if cfg.model.lora.rank is not None and cfg.model.lora.vllm == "adapters" and not found:
        found = vllm_lora_problems(archs, int(cfg.model.lora.rank))
    if found:
        raise ConfigError("rollout.engine=vllm:\n  " + "\n  ".join(found))
    if offload_idle and not facts.sleep_mode:
        log.info("vLLM has no sleep mode on %s: the colocated rollout instance keeps its memory while the "
                 "training roles run (they still offload)", facts.device_type)


def train_main(argv: Sequence[str]) -> int:

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg, _, spec = prepare(argv)
    except (ConfigError, FileNotFoundError, ImportError, AttributeError, ValueError) as e:
        print(f"asyncflow train: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.trainer.threads)
    units = dataclasses.replace(cfg.transfer_queue, stats_path=cfg.transfer_queue.stats_path
                                or str(Path(cfg.trainer.out_dir) / "tq_units.json"))
    # once, before any rank starts: 'auto' becomes what every rank of this node can have
    ranks_here = ranks_sharing_devices(0 if "RANK" in os.environ else cfg.trainer.nproc)
    try:
        platform = get_platform(cfg.trainer.platform, ranks_per_node=ranks_here).name
    except (RuntimeError, ValueError) as e:
        print(f"asyncflow train: trainer.platform={cfg.trainer.platform}: {e}", file=sys.stderr)
        return 2
    resolved = resolve_run(cfg, platform)  # once: the driver and every worker read these values
    if cfg.rollout.engine == "vllm":
        try:
            check_vllm(resolved)
        except (ConfigError, ImportError) as e:
            print(f"asyncflow train: {e}", file=sys.stderr)
            return 2
    run = LaunchConfig(main="asyncflow.training.trainer:driver_main",
                       main_args=(resolved, spec_to_hand_on(spec, cfg.recipe)), platform=platform,
                       driver=DriverConfig(call_timeout_s=cfg.workflow.call_timeout_s), tq_units=units,
                       tq_imports=list(cfg.imports))
    if "RANK" in os.environ:
        problem = under_elastic_agent_problem(cfg.fault.rollout_restarts, os.environ)
        if problem:
            print(f"asyncflow train: {problem}", file=sys.stderr)
            return 2
        return run_from_env(run)

    def describe(rank: int) -> str:
        return rank_roles(Path(cfg.trainer.out_dir), rank)
    if cfg.fault.rollout_restarts:  # torch's launcher would stop every rank when an instance dies
        code = launch_supervised(run, cfg.trainer.nproc, describe_rank=describe)
    else:
        code = launch_local(run, cfg.trainer.nproc, describe_rank=describe)
    if code:
        print(resume_hint(Path(cfg.trainer.out_dir), argv), file=sys.stderr)
    return code


def resume_hint(out_dir: Path, argv: Sequence[str]) -> str:
    """What to run after a failed or interrupted run: the same command resumes from its newest
    complete checkpoint, if it wrote one."""

    found = complete(out_dir)
    if not found:
        return f"asyncflow train: no checkpoint was written in {out_dir} (trainer.save_every), so a new run starts over"
    again = shlex.join(["asyncflow", "train", *[a for a in argv if not a.startswith("trainer.resume=")],
                        "trainer.resume=auto"])
    return f"asyncflow train: the newest checkpoint is {found[-1]}; to go on from it: {again}"


def rank_roles(out_dir: Path, rank: int) -> str:
    """'roles actor, reward' of a rank, from the ranks.json the trainer writes ("" if unknown)."""
    try:
        for w in json.loads((out_dir / "ranks.json").read_text()):
            if w.get("rank") == rank:
                return "roles " + ", ".join(w.get("roles") or ["none"])
    except (OSError, ValueError):
        pass  # the run died before its groups existed: the rank alone must do
    return ""
