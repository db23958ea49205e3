"""The trainer: builds everything from the config and runs warm-up, RL and the report.

Runs in the driver (rank 0) as ``driver_main(driver)``; the worker groups do the work.
Phases: place roles and start worker groups -> supervised warm-up (built-in task)
until a held-out accuracy check passes -> evaluation -> RL through the workflow
executor until ``trainer.steps`` or ``trainer.time_budget_s`` -> evaluation ->
checkpoint, Hugging Face export, ``summary.json`` and the report.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RunSettings, load_config, offload_idle, rank_threads, to_dict
from .workflow import checkpoints as ckpts
from .workflow.checkpoints import RunState

log = logging.getLogger("asyncflow.trainer")
CONFIG_ENV = "ASYNCFLOW_CONFIG"


def resolve_model(cfg: RunSettings) -> str:
    """The model directory: the user's, or the built-in tiny model (built once, cached)."""
    if cfg.model.path:
        return cfg.model.path
    from .models.tiny import TinyModelSpec, ensure_tiny_model
    t = cfg.model.tiny
    spec = TinyModelSpec(hidden_size=t.hidden, num_hidden_layers=t.layers, num_attention_heads=t.heads,
                         num_key_value_heads=t.kv_heads, intermediate_size=t.ffn,
                         max_position_embeddings=t.max_positions,
                         attn_implementation=cfg.model.attn_implementation or "eager",
                         seed=t.seed)
    return str(ensure_tiny_model(spec=spec))


@dataclass
class Placement:
    actor: list[int]
    rollout: list[int]

    @staticmethod
    def from_config(cfg: RunSettings) -> "Placement":
        n = cfg.trainer.nproc
        if cfg.placement.mode == "colocated" or n == 1:
            return Placement(list(range(n)), list(range(n)))
        return Placement(list(cfg.placement.actor_ranks), list(cfg.placement.rollout_ranks))

    def beside(self, side: str) -> list[int]:
        """The ranks of ``side`` ("actor" or "rollout"), for a role placed with it."""
        return self.actor if side == "actor" else self.rollout


def policy_loss_name(cfg: RunSettings) -> str:
    if cfg.algorithm.policy_loss != "auto":
        return cfg.algorithm.policy_loss
    return "decoupled_ppo" if cfg.workflow.mode == "async" else "ppo_clip"


class Training:
    def __init__(self, driver: Any, cfg: RunSettings):
        self.driver = driver
        self.cfg = cfg
        self.out = Path(cfg.trainer.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_path = resolve_model(cfg)
        self.t0 = time.monotonic()
        self.summary: dict[str, Any] = {}
        self.warm_steps = 0
        self.before = float("nan")  # held-out accuracy when RL starts
        self.reference = ""  # the reference model's directory, "" for the base model
        self.saved_version = -1  # the policy version of the newest run checkpoint written

    # ---- set-up ------------------------------------------------------------------------------
    async def _start_groups(self) -> None:
        from .workers.actor import ActorWorker
        from .workers.critic import CriticWorker
        from .workers.reference import ReferenceWorker
        from .workers.reward import RewardWorker
        from .workers.rollout import RolloutWorker

        cfg, d = self.cfg, self.driver
        place = Placement.from_config(cfg)
        threads = rank_threads(cfg)
        attn = cfg.model.attn_implementation or None
        common = {"imports": list(cfg.imports)}
        # Colocated: roles take turns on every rank, so the idle ones free their memory.
        offload = offload_idle(cfg)
        train_common = {**common, "train_engine": cfg.model.train_engine, "offload": offload}
        algo = to_dict(cfg)["algorithm"]
        algo["policy_loss"] = policy_loss_name(cfg)
        self.groups: dict[str, Any] = {}
        self.groups["actor"] = await d.create_group(
            ActorWorker, "actor", ranks=place.actor, model_path=self.model_path,
            optim=self._optim(cfg.optim), algorithm=algo, temperature=cfg.rollout.temperature, threads=threads,
            attn_implementation=attn, seed=cfg.trainer.seed, **train_common)
        stage_roles = {s.role for s in self.stages}
        if "ref" in stage_roles:
            self.groups["ref"] = await d.create_group(
                ReferenceWorker, "ref", ranks=place.beside(cfg.placement.ref_with), model_path=self.model_path,
                temperature=cfg.rollout.temperature, threads=threads, attn_implementation=attn, **train_common)
        if "critic" in stage_roles:
            self.groups["critic"] = await d.create_group(
                CriticWorker, "critic", ranks=place.actor, model_path=self.model_path,
                optim=self._optim(cfg.critic_optim), algorithm=algo, threads=threads, attn_implementation=attn,
                value_loss=cfg.algorithm.value_loss, value_clip=cfg.algorithm.value_clip, **train_common)
        sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
                    "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k}
        self.instances = []
        for k, r in enumerate(place.rollout):  # one instance per rank: each swaps weights on its own
            self.instances.append(await d.create_group(
                RolloutWorker, f"rollout{k}", ranks=[r], model_path=self.model_path, sampling=sampling,
                engine=cfg.rollout.engine, threads=threads, partial_rollout=cfg.rollout.partial_rollout,
                swap_mode=cfg.rollout.swap_mode, max_running_rows=cfg.rollout.max_running_rows,
                max_kv_tokens=cfg.rollout.max_kv_tokens, prefill_chunk=cfg.rollout.prefill_chunk,
                attn_implementation=attn, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                offload=offload, **common))
        reward_ranks = place.beside(cfg.placement.reward_with)
        if cfg.reward.model_path:
            from .workers.reward_model import RewardModelWorker
            self.groups["reward"] = await d.create_group(
                RewardModelWorker, "reward", ranks=reward_ranks, model_path=self.model_path,
                reward_model_path=cfg.reward.model_path, threads=threads, attn_implementation=attn, **train_common)
        else:
            self.groups["reward"] = await d.create_group(
                RewardWorker, "reward", ranks=reward_ranks, model_path=self.model_path, reward=cfg.reward.name,
                timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error, **common)
        self._write_ranks()
        actor = self.groups["actor"]
        for inst in self.instances:  # one weight-sync group each: the actor's first rank and the instance
            members = sorted({place.actor[0], *inst.ranks})
            if len(members) > 1:
                await d.make_group(members, backend="gloo", timeout_s=cfg.workflow.call_timeout_s)
        await asyncio.gather(actor.init_weight_sync([inst.ranks for inst in self.instances]),
                             *(inst.init_weight_sync(place.actor[0]) for inst in self.instances))
        self.placement = place

    def _write_ranks(self) -> None:
        """ranks.json: which process (host, pid) serves which roles, for operators (and fault tests)."""
        roles: dict[int, list[str]] = {}
        for g in [*self.groups.values(), *self.instances]:
            for r in g.ranks:
                roles.setdefault(r, []).append(g.role)
        info = [{"rank": ep.rank, "host": ep.info.get("host"), "pid": ep.info.get("pid"),
                 "roles": roles.get(ep.rank, [])}
                for ep in self.driver.ranks if getattr(ep, "info", None)]
        (self.out / "ranks.json").write_text(json.dumps(info, indent=1))

    def _optim(self, o: Any) -> dict:
        total = max(self.cfg.trainer.steps, o.warmup_steps)  # the cosine (min_lr_ratio < 1) spans trainer.steps
        return {"lr": o.lr, "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay, "total_steps": total,
                "grad_clip": o.grad_clip, "min_lr_ratio": o.min_lr_ratio, "micro_batch_tokens": o.micro_batch_tokens,
                "micro_batch_overhead_tokens": o.micro_batch_overhead_tokens,
                "max_nonfinite_in_row": o.max_nonfinite_in_row}

    async def sync_weights(self, version: int) -> None:
        """Publish the actor's weights as ``version`` and have every instance take them."""
        await self.groups["actor"].publish_weights(version)
        await asyncio.gather(*(inst.receive_weights(version) for inst in self.instances))
        for inst in self.instances:  # in turn: never all instances paused at once
            await inst.swap_weights(version)

    async def reward_failures(self) -> dict[str, float]:
        """Reward calls that raised or timed out so far (scored 0 or fatal, by reward.on_error)."""
        per_rank = await self.groups["reward"].stats()
        return {k: float(sum(s[k] for s in per_rank)) for k in ("reward/errors", "reward/timeouts")}

    async def _export(self, path: Path) -> None:
        if path.exists():  # a rerun into the same out_dir replaces the previous export
            import shutil
            shutil.rmtree(path)
        await self.groups["actor"].export_hf(str(path))

    async def evaluate(self, step: int, phase: str) -> float:
        rc = self.cfg.reward
        r = await self.instances[0].evaluate(self.eval_prompts, self.eval_answers, reward=rc.name,
                                             max_new_tokens=self.cfg.rollout.max_new_tokens, timeout_s=rc.timeout_s,
                                             on_error=rc.on_error)
        failures = await self.reward_failures()
        self.logger.log(step, {"eval/accuracy": r["accuracy"], "phase": phase, "eval/version": r["version"],
                               "eval/reward_errors": r["reward_errors"], "eval/reward_timeouts": r["reward_timeouts"],
                               **failures})
        log.info("eval (%s, step %d): accuracy %.3f  e.g. %s", phase, step, r["accuracy"],
                 "; ".join(f"{e['prompt']}{e['response']!r} (want {e['answer']})" for e in r["examples"][:3]))
        return float(r["accuracy"])

    # ---- run checkpoints -----------------------------------------------------------------------
    def _trained_roles(self) -> list[str]:
        return [r for r in ("actor", "critic") if r in self.groups]

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
                await self.groups[role].save_checkpoint(str(tmp / role), extra)
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
        if "ref" in self.groups and self.reference:
            if not Path(self.reference).is_dir():
                raise ckpts.CheckpointError(f"{path}: the reference model {self.reference} it names is gone")
            await self.groups["ref"].load_state(self.reference)
        log.warning("resuming from %s: %d RL steps done; %d prompts that were in flight at the checkpoint are "
                    "issued again", path, state.steps_done, len(state.in_flight))
        self.summary.update({"resumed_from": str(path), "resumed_at_step": state.steps_done,
                             "regenerated_prompts": len(state.in_flight)})

    async def _load_engines(self, path: Path, state: RunState) -> None:
        for role in state.roles:
            await self.groups[role].load_checkpoint(str(path / role))
        self.saved_version = state.steps_done

    # ---- data --------------------------------------------------------------------------------
    def _data(self) -> None:
        from .data.run_data import build_prompt_data
        self.data = build_prompt_data(self.cfg, self.model_path)
        self.eval_prompts = [list(map(int, r["prompt_ids"])) for r in self.data.eval_records]
        self.eval_answers = [str(r["answer"]) for r in self.data.eval_records]

    # ---- phases ------------------------------------------------------------------------------
    async def warmup(self) -> int:
        """Supervised steps on the task's answers until the held-out check passes."""
        w = self.cfg.warmup
        if not w.enabled or self.data.sft_examples is None:
            return 0
        actor = self.groups["actor"]
        await actor.reset_optimizer({**self._optim(self.cfg.optim), "lr": w.lr, "warmup_steps": w.warmup_steps,
                                     "min_lr_ratio": 1.0, "total_steps": 0})
        rng = random.Random(self.cfg.trainer.seed)
        step = 0
        while step < w.max_steps:
            for _ in range(w.check_every):
                batch = self.data.sft_examples(w.batch_size, rng)
                m = (await actor.sft_step([b[0] for b in batch], [b[1] for b in batch]))[0]
                step += 1
                if step % 5 == 0:
                    self.logger.log(step, {"sft/loss": float(m.get("loss", float("nan"))), "phase": "sft"})
            await self.sync_weights(0)
            acc = await self.evaluate(step, "sft")
            if acc >= w.target_accuracy:
                break
        return step

    async def rl(self, resume: Path | None = None, state: RunState | None = None) -> None:
        """RL through the executor, from scratch or from a run checkpoint (``resume``, ``state``)."""
        from .metrics import Progress
        from .metrics.logger import keep_rows
        from .workflow.executor import Executor, ExecutorConfig
        from .workflow.source import PromptSource, longtail_budgets, resume_source

        cfg = self.cfg
        await self.groups["actor"].reset_optimizer(self._optim(cfg.optim))
        first = 0
        records, replay = self.data.train_records(), []
        if state is not None:  # the optimizer and schedule of the checkpoint replace the fresh ones
            await self._load_engines(resume, state)
            first = state.steps_done
            records, replay = resume_source(records, state.next_uid, state.in_flight)
            await self.sync_weights(first)
        ecfg = ExecutorConfig(mode=cfg.workflow.mode, max_staleness=cfg.workflow.max_staleness,
                              group_size=cfg.rollout.n, prompts_per_step=cfg.trainer.prompts_per_step,
                              dynamic_sampling=any(s.kind == "filter" for s in self.stages),
                              max_refill_factor=cfg.algorithm.max_refill_factor,
                              wait_timeout_s=cfg.workflow.call_timeout_s,
                              # apart from other roles, an instance streams rows; colocated, it takes its turn
                              rollout_service=cfg.placement.mode == "disaggregated")
        budget_fn = (longtail_budgets(cfg.trainer.seed, cfg.rollout.max_new_tokens)
                     if cfg.rollout.length_profile == "longtail" else None)
        self.source = PromptSource(records, cfg.rollout.n, cfg.trainer.seed, budget_fn=budget_fn,
                                   start_uid=state.next_uid if state else 0, replay=replay)
        budget = cfg.trainer.time_budget_s
        progress = Progress(None if budget else cfg.trainer.steps - first, enabled=cfg.trainer.progress,
                            desc=f"RL ({budget:.0f} s budget)" if budget else "RL")
        start = time.monotonic()
        totals = {"rows": 0.0, "tokens": 0.0, "stale_sum": 0.0, "stale_max": 0.0}
        last = [start]
        evals: list[asyncio.Task] = []

        async def on_step(rep: Any) -> None:
            # Before any await: which prompts are trained and which are still in flight right now.
            position = (self.source.next_uid, executor.in_flight_uids(rep.step))
            now = time.monotonic()
            m = dict(rep.metrics)
            dt = max(now - last[0], 1e-9)
            last[0] = now
            rows, tokens = m.pop("rows", 0.0), m.pop("tokens", 0.0)
            totals["rows"] += rows
            totals["tokens"] += tokens
            totals["stale_sum"] += m.get("async/staleness_mean", 0.0) * rows
            totals["stale_max"] = max(totals["stale_max"], m.get("async/staleness_max", 0.0))
            m["perf/samples_per_s"] = rows / dt
            m["perf/tokens_per_s"] = tokens / dt
            m["perf/throughput_tokens_per_s_per_device"] = tokens / dt / cfg.trainer.nproc
            m.update({f"timing_s/{k}": v for k, v in rep.timing.items()})
            wall = now - start
            for role, busy in executor.role_busy.items():
                m[f"perf/idle_ratio/{role}"] = max(0.0, 1.0 - busy / max(wall, 1e-9))
            m["step_time_s"] = rep.finished - rep.started
            held = await self.tq.unit_stats()  # the step's partition is cleared: this must not grow
            m["tq/rows_held"] = float(sum(u["rows"] for u in held))
            m["tq/bytes_held"] = float(sum(u["bytes"] for u in held))
            self.logger.log(rep.step + 1, m)
            progress.update(rep.step + 1 - first, m)
            if cfg.trainer.save_every and (rep.step + 1) % cfg.trainer.save_every == 0:
                await self.save_checkpoint(rep.step + 1, *position)
            if cfg.trainer.eval_every and (rep.step + 1) % cfg.trainer.eval_every == 0:
                evals.append(asyncio.create_task(self.evaluate(rep.step + 1, "rl")))
            if cfg.trainer.time_budget_s and wall >= cfg.trainer.time_budget_s:
                executor.stop()

        samples = None
        if cfg.trainer.log_samples:
            if state is not None:  # rows trained after the checkpoint are trained again: drop their lines
                keep_rows(self.out / "samples.jsonl", lambda row: row.get("step", 0) < first)
            samples = open(self.out / "samples.jsonl", "a" if state is not None else "w")

        async def on_trained(step: int, meta: Any) -> None:
            """The audit trail: which prompt, seed and policy version each trained row came from."""
            if samples is None:
                return
            cols = await self.tq.get_columns(meta, ["prompt_index", "seed", "response_ids", "gen_version", "scores",
                                                    "token_versions"])
            resp = cols["response_ids"]
            offs = resp.offsets.tolist()
            vals = resp.values.tolist()
            tv = cols["token_versions"]
            tv_offs, tv_vals = tv.offsets.tolist(), tv.values.tolist()
            for i in range(len(meta)):
                samples.write(json.dumps({
                    "step": step, "uid": int(meta.groups[i]) if meta.groups else -1,
                    "prompt_index": int(cols["prompt_index"].data[i]), "seed": int(cols["seed"].data[i]),
                    "gen_version": int(cols["gen_version"].data[i]), "score": float(cols["scores"].data[i]),
                    "response_ids": vals[offs[i]:offs[i + 1]],
                    "token_versions": tv_vals[tv_offs[i]:tv_offs[i + 1]]}) + "\n")
            samples.flush()

        executor = Executor(ecfg, self.stages, self.groups, self.instances, self.tq, self.source,
                            timeline=self.timeline, on_step=on_step, on_trained=on_trained,
                            start_version=first, first_step=first)
        try:
            await executor.run(max(0, cfg.trainer.steps - first))
        finally:
            progress.close()
            if samples is not None:
                samples.close()
        await asyncio.gather(*evals)
        await self.groups["actor"].wait_weights_sent()
        inst_stats = [(await inst.stats())[0] for inst in self.instances]
        rl_s = time.monotonic() - start
        steps = executor.last_step + 1 if executor.last_step is not None else first
        self.final_version = steps
        self.summary.update({
            "rl_steps": steps, "rl_s": rl_s, "samples_per_s": totals["rows"] / max(rl_s, 1e-9),
            "tokens_per_s": totals["tokens"] / max(rl_s, 1e-9),
            "staleness_mean": totals["stale_sum"] / max(totals["rows"], 1.0), "staleness_max": totals["stale_max"],
            "prompts_issued": executor.prompts_issued, "tq_units": await self.tq.unit_stats(),
            "idle_ratio": {r: max(0.0, 1 - b / rl_s) for r, b in executor.role_busy.items()},
            # per instance: swaps and their pauses ([start, end, version], monotonic clock of the host)
            "rollout_instances": [{"role": inst.role, "ranks": inst.ranks,
                                   **{k: st[k] for k in ("swaps", "aborted", "unknown_aborts", "errors", "tokens",
                                                         "steps", "recomputed_rows", "service_busy_s", "pauses")
                                      if k in st}} for inst, st in zip(self.instances, inst_stats)],
        })

    async def run(self) -> dict:
        from .metrics import MetricsLogger, Timeline, build_report
        from .metrics.logger import METRICS_FILE, keep_rows
        from .transfer_queue import AsyncTransferQueueClient
        from .workflow.recipe import find_recipe
        from .workflow.stages import check_graph

        cfg = self.cfg
        resume = ckpts.find_resume(self.out, cfg.trainer.resume)
        state = ckpts.load_state(resume) if resume is not None else None
        earlier = ckpts.complete(self.out) if state is None else []
        if earlier:  # a fresh run must not be pruned in favour of an earlier run's later steps
            log.warning("starting afresh in %s: removing the checkpoints of an earlier run there (%s); pass "
                        "trainer.resume=auto to continue it instead", self.out, ", ".join(p.name for p in earlier))
            ckpts.remove_all(self.out)
        (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.timeline = Timeline(self.out)
        resumed_at = 0.0
        if state is not None:  # metrics of the steps after the checkpoint are logged again
            resumed_at = keep_rows(self.out / METRICS_FILE, lambda r: r.get("phase") in ("sft", "before_rl") or (
                r.get("phase") != "after_rl" and r.get("step", 0) <= state.steps_done))
        # With the progress bar on, per-step lines stay in the files; evaluations still print.
        self.logger = MetricsLogger(self.out, t0=self.timeline.t0 - resumed_at, console=not cfg.trainer.progress,
                                    append=state is not None)
        recipe = find_recipe(cfg.recipe)
        self.stages = recipe.stages(cfg)
        check_graph(self.stages, ["prompt_ids", "answer", "seed", "prompt_index",
                                  *(["max_new_tokens"] if cfg.rollout.length_profile else [])])
        self.tq = AsyncTransferQueueClient(self.driver.transfer_queue_address)
        try:
            await asyncio.to_thread(self._data)  # tokenizing the prompts must not stall the driver's heartbeat
            await self._start_groups()
            if state is None:
                self.warm_steps = await self.warmup()
                if "ref" in self.groups and self.warm_steps:  # the reference is the policy RL starts from
                    await self._export(self.out / "warmup_model")
                    self.reference = str((self.out / "warmup_model").absolute())
                    await self.groups["ref"].load_state(self.reference)
                await self.sync_weights(0)
                self.before = await self.evaluate(0, "before_rl")
            else:
                await self._resume_roles(resume, state)
            await self.rl(resume, state)
            await self.sync_weights(self.final_version)
            after = await self.evaluate(self.summary["rl_steps"], "after_rl")
            if self.final_version != self.saved_version:
                await self.save_checkpoint(self.final_version, self.source.next_uid, [])
            await self._export(self.out / "hf_model")
            self.summary.update({
                "eval_accuracy_before_rl": self.before, "eval_accuracy_after_rl": after,
                "accuracy_gain": after - self.before, "warmup_steps": self.warm_steps,
                "wall_s": time.monotonic() - self.t0, "mode": cfg.workflow.mode, "recipe": recipe.name,
                "placement": cfg.placement.mode, "nproc": cfg.trainer.nproc, "model_path": self.model_path,
                "filtered_prompts": getattr(self.data, "filtered", 0), **await self.reward_failures(),
            })
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2))
        finally:
            self.logger.close()
            self.timeline.close()
            await self.tq.close()
        paths = build_report(self.out)
        log.info("run finished: accuracy %.3f -> %.3f in %.0f s; report: %s", self.summary.get(
            "eval_accuracy_before_rl", float("nan")), self.summary.get("eval_accuracy_after_rl", float("nan")),
            self.summary.get("wall_s", 0.0), ", ".join(str(p) for p in paths.values()))
        print(json.dumps({k: v for k, v in self.summary.items() if not isinstance(v, (dict, list))}), flush=True)
        return self.summary


async def driver_main(driver: Any) -> None:
    """The launch entry of rank 0 (``RunConfig.main``); the config comes through the environment."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise RuntimeError(f"{CONFIG_ENV} is not set: start runs with `asyncflow train`")
    logging.getLogger("asyncflow").setLevel(logging.INFO)
    cfg = load_config(path)
    await Training(driver, cfg).run()
