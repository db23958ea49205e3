"""The trainer: builds a run from its config and recipe, runs warm-up, RL and the report.

Runs in the driver (rank 0) as ``driver_main(driver)``; the worker groups do the work.
Phases: start the recipe's roles -> supervised warm-up (built-in task) until a held-out
accuracy check passes -> evaluation -> RL through the workflow executor until
``trainer.steps`` or ``trainer.time_budget_s`` -> evaluation -> checkpoint, Hugging Face
export, ``summary.json`` and the report. The parts live beside it in ``asyncflow.training``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from ..config import RunConfig, to_dict
from ..data.run_data import build_prompt_data
from ..metrics import MetricsLogger, Progress, Timeline, build_report
from ..metrics.logger import METRICS_FILE, keep_rows
from ..models.loading import load_tokenizer
from ..models.tiny import TinyModelSpec, ensure_tiny_model
from ..resolved import ResolvedRun
from ..single_controller.driver import Driver
from ..transfer_queue import AsyncTransferQueueClient
from ..workflow import checkpoints as ckpts
from ..workflow.checkpoints import RunState
from ..workflow.executor import Executor, ExecutorConfig
from ..workflow.recipe import find_recipe
from ..workflow.source import PromptSource, Record, longtail_budgets, resume_source
from ..workflow.stages import RecipeSpec
from . import phases
from .instance_faults import InstanceFaults
from .observers import CheckpointPolicy, EvalSchedule, SampleAudit, StepMetrics, StopFile, TimeBudget
from .roles import RunRoles, init_weight_sync, start_roles, write_ranks

log = logging.getLogger("asyncflow.trainer")


def resolve_model(cfg: RunConfig) -> str:
    """The model directory: the user's, or the built-in tiny model (built once, cached)."""
    if cfg.model.path:
        return cfg.model.path
    t = cfg.model.tiny
    spec = TinyModelSpec(hidden_size=t.hidden, num_hidden_layers=t.layers, num_attention_heads=t.heads,
                         num_key_value_heads=t.kv_heads, intermediate_size=t.ffn,
                         max_position_embeddings=t.max_positions,
                         attn_implementation=cfg.model.attn_implementation or "eager",
                         seed=t.seed)
    return str(ensure_tiny_model(spec=spec))


def source_columns(cfg: RunConfig) -> list[str]:
    """The columns the prompt source writes for every row (what a recipe's first stages read)."""
    return ["prompt_ids", "answer", "seed", "prompt_index", "prompt", "metadata",
            *(["max_new_tokens"] if cfg.rollout.length_profile else [])]


def episode_summary(instances: list[dict]) -> dict[str, Any]:
    """Tool statistics over every instance's episodes (nothing for a run without episodes)."""
    total = {k: sum(i.get("episodes", {}).get(k, 0) for i in instances)
             for k in ("episodes", "turns", "tool_calls", "tool_errors")}
    if not total["episodes"]:
        return {}
    n = total["episodes"]
    return {"episodes": n, "turns_mean": total["turns"] / n, "tool_calls_per_episode": total["tool_calls"] / n,
            "tool_errors": total["tool_errors"]}


class Training:
    def __init__(self, driver: Driver, run: ResolvedRun, spec: RecipeSpec | None = None):
        self.driver = driver
        self.run_spec = run  # as the launcher resolved it: model.path and the derived values included
        self.built = spec  # the launcher's built recipe, None where it did not pickle
        self.cfg = cfg = run.config
        # The config as plain values, made once: OmegaConf's conversion is slow, and each checkpoint
        # written in the loop would stall the driver's event loop for it.
        self.cfg_dict: dict[str, Any] = to_dict(cfg)  # read-only, like cfg
        self.out = Path(cfg.trainer.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_path = cfg.model.path
        self.t0 = time.monotonic()
        self.summary: dict[str, Any] = {}
        self.warm_steps = 0
        self.before = float("nan")  # held-out accuracy when RL starts
        self.reference = ""  # the reference model's directory, "" for the base model
        self.saved_version = -1  # the policy version of the newest run checkpoint written

    # ---- run checkpoints -----------------------------------------------------------------------
    def _trained_roles(self) -> list[str]:
        return [g.role for g in self.roles.with_method("save_checkpoint")]

    async def save_checkpoint(self, steps_done: int, next_uid: int, in_flight: list[int]) -> Path:
        """Every training engine and the driver's state into checkpoints/step_<n>, atomically."""
        target = ckpts.step_dir(self.out, steps_done)
        roles = self._trained_roles()
        state = RunState(steps_done=steps_done, next_uid=next_uid, in_flight=list(in_flight),
                         prompts_consumed=next_uid - len(in_flight),
                         warmup_steps=self.warm_steps, accuracy_before_rl=self.before, reference=self.reference,
                         roles=roles)
        start = time.monotonic()
        tmp = None
        try:
            tmp = ckpts.begin(target)
            extra = {"steps_done": steps_done, "next_uid": next_uid}
            for role in roles:  # one at a time: they share ranks, and a failure stops at the first
                await self.roles.groups[role].save_checkpoint(str(tmp / role), extra)
            ckpts.write_config(tmp, self.cfg_dict)
            ckpts.commit(tmp, target, state)
        except Exception as e:
            if tmp is not None:
                ckpts.abandon(tmp)
            prev = [p for p in ckpts.complete(self.out) if p != target]
            kept = f"the previous checkpoint {prev[-1]} is untouched" if prev else "no earlier checkpoint exists"
            raise ckpts.CheckpointError(
                f"writing the checkpoint after RL step {steps_done} to {target} failed ({e}); {kept}. Free disk "
                "space or fix the path, then rerun with trainer.resume=auto") from e
        self.saved_version = steps_done
        ckpts.prune(self.out, self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint %s written in %.1f s (%d prompts in flight)", target, time.monotonic() - start,
                 len(in_flight))
        return target

    async def _resume_roles(self, path: Path, state: RunState) -> None:
        """What warm-up left behind: its outcome and the reference model."""
        self.warm_steps, self.before, self.reference = state.warmup_steps, state.accuracy_before_rl, state.reference
        if set(state.roles) != set(self._trained_roles()):
            raise ckpts.CheckpointError(
                f"{path} holds the engines of {state.roles}, but this recipe trains {self._trained_roles()}: "
                "resume with the recipe and algorithm the checkpoint was written with")
        if self.reference:
            if not Path(self.reference).is_dir():
                raise ckpts.CheckpointError(f"{path}: the reference model {self.reference} it names is gone")
            for g in self.roles.with_method("load_reference"):
                await g.load_reference(self.reference)
        log.warning("resuming from %s: %d RL steps done; %d prompts that were in flight at the checkpoint are "
                    "issued again", path, state.steps_done, len(state.in_flight))
        changes = ckpts.config_changes(path, self.cfg_dict)
        if changes:  # allowed (a new learning rate, say), but never silent
            log.warning("resuming with %d settings other than those of the run that wrote %s (its %s): %s",
                        len(changes), path.name, ckpts.CONFIG_FILE, "; ".join(changes))
        self.summary.update({"resumed_from": str(path), "resumed_at_step": state.steps_done,
                             "regenerated_prompts": len(state.in_flight), "resume_config_changes": changes})

    async def _load_engines(self, path: Path, state: RunState) -> None:
        for role in state.roles:
            await self.roles.groups[role].load_checkpoint(str(path / role))
        self.saved_version = state.steps_done

    async def _export(self, path: Path) -> None:
        if path.exists():  # a rerun into the same out_dir replaces the previous export
            shutil.rmtree(path)
        await self.roles.policy.export_hf(str(path))

    # ---- data --------------------------------------------------------------------------------
    def _data(self) -> None:
        self.data = build_prompt_data(self.cfg, self.model_path)

    # ---- RL ----------------------------------------------------------------------------------
    async def rl(self, checkpoint: tuple[Path, RunState] | None = None) -> None:
        """RL through the executor, from scratch or from a run checkpoint (its path and state)."""
        cfg, roles = self.cfg, self.roles
        for g in roles.with_method("reset_optimizer"):
            await g.reset_optimizer("rl")
        first, records = 0, self.data.train_records()
        replay: list[tuple[int, Record]] = []
        state: RunState | None = None
        if checkpoint is not None:  # the optimizer and schedule of the checkpoint replace the fresh ones
            path, state = checkpoint
            await self._load_engines(path, state)
            first = state.steps_done
            records, replay = resume_source(records, state.next_uid, state.in_flight)
            await phases.sync_weights(roles, first)
        budget_fn = (longtail_budgets(cfg.trainer.seed, cfg.rollout.max_new_tokens)
                     if cfg.rollout.length_profile == "longtail" else None)
        self.source = PromptSource(records, cfg.rollout.n, cfg.trainer.seed, budget_fn=budget_fn,
                                   start_uid=state.next_uid if state else 0, replay=replay)
        ecfg = ExecutorConfig(mode=cfg.workflow.mode, max_staleness=cfg.workflow.max_staleness,
                              group_size=cfg.rollout.n, prompts_per_step=cfg.trainer.prompts_per_step,
                              dynamic_sampling=any(s.kind == "filter" for s in self.spec.stages),
                              max_refill_factor=cfg.algorithm.max_refill_factor,
                              wait_timeout_s=cfg.workflow.call_timeout_s,
                              # apart from other roles, an instance streams rows; colocated, it takes its turn
                              rollout_service=cfg.placement.mode == "disaggregated",
                              swaps_at_once=cfg.weight_sync.swaps_at_once)
        budget = cfg.trainer.time_budget_s
        progress = Progress(None if budget else cfg.trainer.steps - first, enabled=cfg.trainer.progress,
                            desc=f"RL ({budget:.0f} s budget)" if budget else "RL")
        metrics = StepMetrics(self.logger, progress, self.tq, cfg.trainer.nproc, first)
        evals = EvalSchedule(cfg.trainer.eval_every, self.evaluate)
        executor: Executor | None = None  # the budget stops the executor built below

        def stop() -> None:  # called by an observer, so from inside the executor's run
            if executor is None:
                raise RuntimeError("trainer.time_budget_s / trainer.stop_file: RL was stopped before the executor "
                                   "was built")
            executor.stop()
        observers = [metrics, CheckpointPolicy(cfg.trainer.save_every, self.save_checkpoint), evals,
                     TimeBudget(budget, stop)]
        stop_path = cfg.trainer.stop_path()
        if stop_path is not None:
            observers.append(StopFile(stop_path, stop))
        audit = None
        if cfg.trainer.log_samples:
            if state is not None:  # rows trained after the checkpoint are trained again: drop their lines
                keep_rows(self.out / "samples.jsonl", lambda row: row.get("step", 0) < first)
            written = [*source_columns(cfg), *(c for s in self.spec.stages for c in s.outputs)]
            decode = None
            if "loss_mask" in written:  # episodes: the audit shows their turns as text
                decode = load_tokenizer(self.model_path)
            audit = SampleAudit(self.out / "samples.jsonl", append=state is not None, columns=written, decode=decode)
            observers.insert(0, audit)
        faults = None
        if cfg.fault.rollout_restarts:  # a lost rollout instance is replaced, the run goes on
            faults = InstanceFaults(self.driver, cfg.fault, roles.policy, roles.instances)
            faults.on_back = lambda: write_ranks(self.driver, roles, self.out)  # the new process's pid
        executor = Executor(ecfg, self.spec.stages, roles.groups, roles.instances, self.tq, self.source,
                            timeline=self.timeline, observers=observers, start_version=first, first_step=first,
                            policy=self.spec.policy, faults=faults)
        if faults is not None:
            faults.arm(executor)
        # The models, the data and the executor are built: a full collection in the loop
        # walks only what the loop makes from here.
        await self.driver.freeze_heaps()
        start = time.monotonic()
        try:
            await executor.run(max(0, cfg.trainer.steps - first))
        finally:
            progress.close()
            if audit is not None:
                audit.close()
        if faults is not None:
            self.summary["faults"] = faults.summary()
            await self._after_faults(executor)
        await evals.wait()
        rl_s = time.monotonic() - start
        steps = executor.last_step + 1 if executor.last_step is not None else first
        self.final_version = steps
        self.summary.update({
            "rl_steps": steps, "rl_s": rl_s, **metrics.summary(rl_s),
            "prompts_issued": executor.prompts_issued, "tq_units": await self.tq.unit_stats(),
            "idle_ratio": {r: max(0.0, 1 - b / rl_s) for r, b in executor.role_busy.items()},
            "rollout_instances": await self._instance_stats(),
        })
        self.summary.update(episode_summary(self.summary["rollout_instances"]))

    async def _after_faults(self, executor: Any) -> None:
        """After RL with lost instances: the evaluation and the last sync use the instances in
        service, in weight-sync groups of their own."""
        roles = self.roles
        serving = [inst for k, inst in enumerate(roles.instances) if k not in executor.out_of_service]
        if len(serving) < len(roles.instances):
            log.warning("after RL: %d rollout instance(s) are out of service; evaluating on the other %d",
                        len(roles.instances) - len(serving), len(serving))
        if executor.faults.restarts or len(serving) < len(roles.instances):
            roles.instances[:] = serving
            await init_weight_sync(roles.policy, serving)

    async def _instance_stats(self) -> list[dict]:
        """Per instance: swaps and their pauses ([start, end, version], monotonic clock of the host)."""
        keys = ("swaps", "aborted", "unknown_aborts", "errors", "tokens", "steps", "recomputed_rows", "rows_written",
                "service_busy_s", "pauses", "episodes")
        out = []
        for inst in self.roles.instances:
            st = (await inst.stats())[0]
            out.append({"role": inst.role, "ranks": inst.ranks, **{k: st[k] for k in keys if k in st}})
        return out

    # ---- the whole run -------------------------------------------------------------------------
    async def run(self) -> dict:
        cfg = self.cfg
        # The launcher's build, handed on as it is; a recipe whose built stages do not pickle
        # (closures) is built again here from the same resolved config.
        recipe = find_recipe(cfg.recipe)
        self.spec = self.built if self.built is not None else recipe.build(cfg, source_columns(cfg))
        resume = ckpts.find_resume(self.out, cfg.trainer.resume)
        checkpoint = (resume, ckpts.load_state(resume)) if resume is not None else None
        state = checkpoint[1] if checkpoint is not None else None
        earlier = ckpts.complete(self.out) if state is None else []
        if earlier:  # a fresh run must not be pruned in favour of an earlier run's later steps
            log.warning("starting afresh in %s: removing the checkpoints of an earlier run there (%s); pass "
                        "trainer.resume=auto to continue it instead", self.out, ", ".join(p.name for p in earlier))
            ckpts.remove_all(self.out)
        (self.out / "config.json").write_text(json.dumps(self.cfg_dict, indent=2))
        self.timeline = Timeline(self.out)
        resumed_at = 0.0
        if state is not None:  # metrics of the steps after the checkpoint are logged again
            resumed_at = keep_rows(self.out / METRICS_FILE, lambda r: r.get("phase") in ("sft", "before_rl") or (
                r.get("phase") != "after_rl" and r.get("step", 0) <= state.steps_done))
        # With the progress bar on, per-step lines stay in the files; evaluations still print.
        self.logger = MetricsLogger(self.out, t0=self.timeline.t0 - resumed_at, console=not cfg.trainer.progress,
                                    append=state is not None, backends=cfg.trainer.loggers,
                                    wandb_init={"config": dict(self.cfg_dict), **cfg.trainer.wandb})
        if self.driver.transfer_queue_address is None:
            raise RuntimeError("the driver has no TransferQueue (the launch config turned it off): the trainer "
                               "needs one")
        self.tq = AsyncTransferQueueClient(self.driver.transfer_queue_address)
        try:
            await asyncio.to_thread(self._data)  # tokenizing the prompts must not stall the driver's heartbeat
            self.roles: RunRoles = await start_roles(self.driver, self.run_spec, self.spec, self.out)
            episode = next((s.options.get("episode", "") for s in self.spec.stages if s.kind == "rollout"), "")
            self.evaluate = phases.Evaluator(cfg, self.roles, self.logger, self.data.eval_records, episode)
            if checkpoint is None:
                self.warm_steps = await phases.warmup(cfg, self.roles, self.data, self.logger, self.evaluate)
                refs = self.roles.with_method("load_reference")
                if refs and self.warm_steps:  # the reference is the policy RL starts from
                    await self._export(self.out / "warmup_model")
                    self.reference = str((self.out / "warmup_model").absolute())
                    for g in refs:
                        await g.load_reference(self.reference)
                await phases.sync_weights(self.roles, 0)
                self.before = await self.evaluate(0, "before_rl")
            else:
                await self._resume_roles(*checkpoint)
            await self.rl(checkpoint)
            await phases.sync_weights(self.roles, self.final_version)
            after = await self.evaluate(self.summary["rl_steps"], "after_rl")
            if self.final_version != self.saved_version:
                await self.save_checkpoint(self.final_version, self.source.next_uid, [])
            await self._export(self.out / "hf_model")
            self.summary.update({
                "eval_accuracy_before_rl": self.before, "eval_accuracy_after_rl": after,
                "accuracy_gain": after - self.before, **self.evaluate.summary(), "warmup_steps": self.warm_steps,
                "wall_s": time.monotonic() - self.t0, "mode": cfg.workflow.mode, "recipe": recipe.name,
                "placement": cfg.placement.mode, "nproc": cfg.trainer.nproc, "model_path": self.model_path,
                "filtered_prompts": getattr(self.data, "filtered", 0), **await phases.reward_failures(self.roles),
            })
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2))
        finally:
            self.logger.close()
            self.timeline.close()
            await self.tq.close()
        # off the event loop: drawing the charts takes seconds on a loaded machine, and the loop must
        # keep answering the ranks' heartbeats meanwhile
        paths = await asyncio.to_thread(build_report, self.out)
        log.info("run finished: accuracy %.3f -> %.3f in %.0f s; report: %s", self.summary.get(
            "eval_accuracy_before_rl", float("nan")), self.summary.get("eval_accuracy_after_rl", float("nan")),
            self.summary.get("wall_s", 0.0), ", ".join(str(p) for p in paths.values()))
        print(json.dumps({k: v for k, v in self.summary.items() if not isinstance(v, (dict, list))}), flush=True)
        return self.summary


async def driver_main(driver: Driver, run: ResolvedRun | None = None, spec: RecipeSpec | None = None) -> None:
    """The launch entry of rank 0 (``LaunchConfig.main``); ``run`` and ``spec`` are the launcher's
    resolved run and built recipe (``LaunchConfig.main_args``), taken as they are: nothing is
    checked, resolved or built again (but a recipe that did not pickle: ``spec`` None)."""
    if not isinstance(run, ResolvedRun):
        raise RuntimeError("asyncflow.training.trainer:driver_main needs the run the launcher resolved "
                           "(its main_args): start runs with `asyncflow train`")
    logging.getLogger("asyncflow").setLevel(logging.INFO)
    await Training(driver, run, spec).run()
