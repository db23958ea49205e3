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

from .config import RunSettings, load_config, to_dict

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

    # ---- set-up ------------------------------------------------------------------------------
    async def _start_groups(self) -> None:
        from .workers.actor import ActorWorker
        from .workers.critic import CriticWorker
        from .workers.reference import ReferenceWorker
        from .workers.reward import RewardWorker
        from .workers.rollout import RolloutWorker

        cfg, d = self.cfg, self.driver
        place = Placement.from_config(cfg)
        threads = cfg.trainer.threads
        attn = cfg.model.attn_implementation or None
        common = {"imports": list(cfg.imports)}
        train_common = {**common, "train_engine": cfg.model.train_engine}
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
                ReferenceWorker, "ref", ranks=place.actor, model_path=self.model_path,
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
                attn_implementation=attn, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, **common))
        reward_ranks = place.actor if cfg.placement.reward_with == "actor" else place.rollout
        if cfg.reward.model_path:
            from .workers.reward_model import RewardModelWorker
            self.groups["reward"] = await d.create_group(
                RewardModelWorker, "reward", ranks=reward_ranks, model_path=self.model_path,
                reward_model_path=cfg.reward.model_path, threads=threads, attn_implementation=attn, **train_common)
        else:
            self.groups["reward"] = await d.create_group(
                RewardWorker, "reward", ranks=reward_ranks, model_path=self.model_path, reward=cfg.reward.name,
                timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error, **common)
        actor = self.groups["actor"]
        await asyncio.gather(actor.init_weight_sync([inst.ranks for inst in self.instances]),
                             *(inst.init_weight_sync(place.actor[0]) for inst in self.instances))
        self.placement = place

    def _optim(self, o: Any) -> dict:
        total = max(self.cfg.trainer.steps, o.warmup_steps)  # the cosine (min_lr_ratio < 1) spans trainer.steps
        return {"lr": o.lr, "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay, "total_steps": total,
                "grad_clip": o.grad_clip, "min_lr_ratio": o.min_lr_ratio, "micro_batch_tokens": o.micro_batch_tokens,
                "max_nonfinite_in_row": o.max_nonfinite_in_row}

    async def sync_weights(self, version: int) -> None:
        """Publish the actor's weights as ``version`` and have every instance take them."""
        await self.groups["actor"].publish_weights(version)
        await asyncio.gather(*(inst.receive_weights(version) for inst in self.instances))

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
        r = await self.instances[0].evaluate(self.eval_prompts, self.eval_answers, reward=self.cfg.reward.name,
                                             max_new_tokens=self.cfg.rollout.max_new_tokens)
        failures = await self.reward_failures()
        self.logger.log(step, {"eval/accuracy": r["accuracy"], "phase": phase, "eval/version": r["version"],
                               **failures})
        log.info("eval (%s, step %d): accuracy %.3f  e.g. %s", phase, step, r["accuracy"],
                 "; ".join(f"{e['prompt']}{e['response']!r} (want {e['answer']})" for e in r["examples"][:3]))
        return float(r["accuracy"])

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

    async def rl(self) -> None:
        from .metrics import Progress
        from .workflow.executor import Executor, ExecutorConfig
        from .workflow.source import PromptSource, longtail_budgets

        cfg = self.cfg
        await self.groups["actor"].reset_optimizer(self._optim(cfg.optim))
        ecfg = ExecutorConfig(mode=cfg.workflow.mode, max_staleness=cfg.workflow.max_staleness,
                              group_size=cfg.rollout.n, prompts_per_step=cfg.trainer.prompts_per_step,
                              dynamic_sampling=any(s.kind == "filter" for s in self.stages),
                              max_refill_factor=cfg.algorithm.max_refill_factor,
                              wait_timeout_s=cfg.workflow.call_timeout_s)
        budget_fn = (longtail_budgets(cfg.trainer.seed, cfg.rollout.max_new_tokens)
                     if cfg.rollout.length_profile == "longtail" else None)
        self.source = PromptSource(self.data.train_records(), cfg.rollout.n, cfg.trainer.seed, budget_fn=budget_fn)
        budget = cfg.trainer.time_budget_s
        progress = Progress(None if budget else cfg.trainer.steps, enabled=cfg.trainer.progress,
                            desc=f"RL ({budget:.0f} s budget)" if budget else "RL")
        start = time.monotonic()
        totals = {"rows": 0.0, "tokens": 0.0, "stale_sum": 0.0, "stale_max": 0.0}
        last = [start]
        evals: list[asyncio.Task] = []

        async def on_step(rep: Any) -> None:
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
            self.logger.log(rep.step + 1, m)
            progress.update(rep.step + 1, m)
            if cfg.trainer.eval_every and (rep.step + 1) % cfg.trainer.eval_every == 0:
                evals.append(asyncio.create_task(self.evaluate(rep.step + 1, "rl")))
            if cfg.trainer.time_budget_s and wall >= cfg.trainer.time_budget_s:
                executor.stop()

        samples = open(self.out / "samples.jsonl", "w") if cfg.trainer.log_samples else None

        async def on_trained(step: int, meta: Any) -> None:
            """The audit trail: which prompt, seed and policy version each trained row came from."""
            if samples is None:
                return
            cols = await self.tq.get_columns(meta, ["prompt_index", "seed", "response_ids", "gen_version", "scores"])
            resp = cols["response_ids"]
            offs = resp.offsets.tolist()
            vals = resp.values.tolist()
            for i in range(len(meta)):
                samples.write(json.dumps({
                    "step": step, "prompt_index": int(cols["prompt_index"].data[i]), "seed": int(cols["seed"].data[i]),
                    "gen_version": int(cols["gen_version"].data[i]), "score": float(cols["scores"].data[i]),
                    "response_ids": vals[offs[i]:offs[i + 1]]}) + "\n")
            samples.flush()

        executor = Executor(ecfg, self.stages, self.groups, self.instances, self.tq, self.source,
                            timeline=self.timeline, on_step=on_step, on_trained=on_trained)
        try:
            await executor.run(cfg.trainer.steps)
        finally:
            progress.close()
            if samples is not None:
                samples.close()
        await asyncio.gather(*evals)
        await self.groups["actor"].wait_weights_sent()
        rl_s = time.monotonic() - start
        steps = (executor.last_step or -1) + 1
        self.final_version = steps
        self.summary.update({
            "rl_steps": steps, "rl_s": rl_s, "samples_per_s": totals["rows"] / max(rl_s, 1e-9),
            "tokens_per_s": totals["tokens"] / max(rl_s, 1e-9),
            "staleness_mean": totals["stale_sum"] / max(totals["rows"], 1.0), "staleness_max": totals["stale_max"],
            "prompts_issued": executor.prompts_issued,
            "idle_ratio": {r: max(0.0, 1 - b / rl_s) for r, b in executor.role_busy.items()},
        })

    async def run(self) -> dict:
        from .metrics import MetricsLogger, Timeline, build_report
        from .transfer_queue import AsyncTransferQueueClient
        from .workflow.recipe import find_recipe
        from .workflow.stages import check_graph

        cfg = self.cfg
        (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.timeline = Timeline(self.out)
        # With the progress bar on, per-step lines stay in the files; evaluations still print.
        self.logger = MetricsLogger(self.out, t0=self.timeline.t0, console=not cfg.trainer.progress)
        recipe = find_recipe(cfg.recipe)
        self.stages = recipe.stages(cfg)
        check_graph(self.stages, ["prompt_ids", "answer", "seed", "prompt_index",
                                  *(["max_new_tokens"] if cfg.rollout.length_profile else [])])
        self.tq = AsyncTransferQueueClient(self.driver.transfer_queue_address)
        try:
            await asyncio.to_thread(self._data)  # tokenizing the prompts must not stall the driver's heartbeat
            await self._start_groups()
            warm_steps = await self.warmup()
            if "ref" in self.groups and warm_steps:  # the reference is the policy RL starts from
                await self._export(self.out / "warmup_model")
                await self.groups["ref"].load_state(str(self.out / "warmup_model"))
            await self.sync_weights(0)
            before = await self.evaluate(0, "before_rl")
            await self.rl()
            await self.sync_weights(self.final_version)
            after = await self.evaluate(self.summary["rl_steps"], "after_rl")
            ckpt = self.out / "checkpoint"
            await self.groups["actor"].save_checkpoint(str(ckpt), {"prompts_issued": self.source.next_uid,
                                                                    "version": self.final_version})
            await self._export(self.out / "hf_model")
            self.summary.update({
                "eval_accuracy_before_rl": before, "eval_accuracy_after_rl": after,
                "accuracy_gain": after - before, "warmup_steps": warm_steps,
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
        print(json.dumps({k: v for k, v in self.summary.items() if not isinstance(v, dict)}), flush=True)
        return self.summary


async def driver_main(driver: Any) -> None:
    """The launch entry of rank 0 (``RunConfig.main``); the config comes through the environment."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise RuntimeError(f"{CONFIG_ENV} is not set: start runs with `asyncflow train`")
    logging.getLogger("asyncflow").setLevel(logging.INFO)
    cfg = load_config(path)
    await Training(driver, cfg).run()
