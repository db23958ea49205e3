"""The phases around RL: weight sync to the rollout instances, evaluation on held-out
prompts, and the supervised warm-up of the built-in task."""
from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from .. import column_names as col
from ..config import RunConfig
from ..data.run_data import RunData
from ..metrics.logger import MetricsLogger
from ..rewards.custom import reward_ref
from ..rewards.runner import extra_means
from ..single_controller.errors import WorkerDiedError
from ..weight_sync.publish import publish_and_swap
from .eval_merge import merge_evaluations, split_prompts
from .roles import RunRoles

log = logging.getLogger("asyncflow.trainer")


async def sync_weights(roles: RunRoles, version: int) -> None:
    """Publish the policy's weights as ``version`` and have every instance take them, one
    instance at a time: never all instances paused at once."""
    await publish_and_swap(roles.policy, roles.instances, version, wave=1)


async def reward_totals(roles: RunRoles, lost_ok: bool = False) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Reward calls that raised or timed out so far, and the sums of the reward's extras so far
    ({key: [sum, rows]}), over every role that counts them. ``lost_ok`` (fault.rollout_restarts):
    a lost rollout instance is left out (its counts went with its process)."""
    total = {"reward/errors": 0.0, "reward/timeouts": 0.0}
    extra: dict[str, list[float]] = {}
    for g in roles.with_method("reward_stats", instances=True):
        try:
            stats = await g.reward_stats()
        except WorkerDiedError:
            if not (lost_ok and g in roles.instances):
                raise
            continue
        for s in stats:
            for k in total:
                total[k] += float(s.get(k, 0))
            for k, (v, n) in dict(s.get("reward/extra") or {}).items():
                acc = extra.setdefault(k, [0.0, 0])
                acc[0] += float(v)
                acc[1] += int(n)
    return total, extra


async def reward_failures(roles: RunRoles) -> dict[str, float]:
    """Reward calls that raised or timed out so far, over every role that counts them."""
    return (await reward_totals(roles))[0]


class Evaluator:
    """Greedy accuracy on the held-out prompts and, with ``trainer.eval_samples``, pass@k and
    mean@n of sampled responses; the prompts are split over every rollout instance (each
    evaluates its share concurrently) and the replies merged (asyncflow.training.eval_merge)."""

    def __init__(self, cfg: RunConfig, roles: RunRoles, logger: MetricsLogger, records: list[dict], episode: str = ""):
        self.cfg, self.roles, self.logger = cfg, roles, logger
        self.episode = episode  # multi-turn recipes: each prompt is a greedy episode scored by itself
        self.prompts = [[int(x) for x in r[col.PROMPT_IDS]] for r in records]
        self.answers = [str(r["answer"]) for r in records]
        # what a reward function gets besides response and answer, as in training
        self.extra = [{**dict(r.get("metadata") or {}), "prompt": str(r.get("prompt", ""))} for r in records]
        self._extra_seen: dict[str, list[float]] = {}  # the training extras' sums at the previous evaluation
        self.sampled: dict[str, dict[str, float]] = {}  # phase -> its latest eval/pass@k, eval/mean@n

    def _seeds(self, ids: list[int]) -> list[int]:
        """The first sample seed of each prompt (its j-th sample: + j): fixed by the prompt's index,
        so a prompt draws the same samples whichever instance evaluates it."""
        n = max(self.cfg.trainer.eval_samples, 1)
        return [(self.cfg.trainer.seed * len(self.prompts) + i) * n for i in ids]

    async def __call__(self, step: int, phase: str) -> float:
        rc, t = self.cfg.reward, self.cfg.trainer
        parts = split_prompts(len(self.prompts), len(self.roles.instances))
        busy = [(inst, part) for inst, part in zip(self.roles.instances, parts) if part]

        def evaluate(inst: Any, part: list[int]) -> Any:
            return inst.evaluate([self.prompts[i] for i in part], [self.answers[i] for i in part],
                                 reward=reward_ref(rc), max_new_tokens=self.cfg.rollout.max_new_tokens,
                                 timeout_s=rc.timeout_s, on_error=rc.on_error, extra=[self.extra[i] for i in part],
                                 episode=self.episode, n_samples=t.eval_samples, temperature=t.eval_temperature,
                                 seeds=self._seeds(part))
        if self.cfg.fault.rollout_restarts:
            replies = await evaluate_surviving_loss(busy, evaluate)
        else:
            replies = await asyncio.gather(*(evaluate(inst, part) for inst, part in busy))
        r = merge_evaluations([part for _, part in busy], replies, t.eval_samples, t.eval_k)
        failures, extra = await reward_totals(self.roles, lost_ok=self.cfg.fault.rollout_restarts)
        # a dict-returning reward's other keys: over the training rows scored since the last evaluation,
        # and over this evaluation's rows
        extras = {**{f"reward/extra/{k}": v for k, v in extra_means(extra, self._extra_seen).items()},
                  **{f"eval/extra/{k}": v for k, v in dict(r.get("reward_extra") or {}).items()}}
        self._extra_seen = extra
        episodes = {f"eval/{k}": r[k] for k in ("turns_mean", "tool_calls_per_episode") if k in r}
        sampled = {f"eval/{k}": v for k, v in r.items() if k.startswith(("pass@", "mean@"))}
        self.sampled[phase] = sampled
        self.logger.log(step, {"eval/accuracy": r["accuracy"], "phase": phase, "eval/version": r["version"],
                               "eval/reward_errors": r["reward_errors"],
                               "eval/reward_timeouts": r["reward_timeouts"], **sampled, **episodes, **failures,
                               **extras})
        log.info("eval (%s, step %d): accuracy %.3f%s  e.g. %s", phase, step, r["accuracy"],
                 "".join(f", {k[5:]} {v:.3f}" for k, v in sampled.items()),
                 "; ".join(f"{e['prompt']}{e['response']!r} (want {e['answer']})" for e in r["examples"][:3]))
        return float(r["accuracy"])

    def summary(self) -> dict[str, float]:
        """The sampled figures of the evaluations before and after RL, for summary.json
        (``eval_pass@1_before_rl``, ``eval_mean@4_after_rl``, ...)."""
        return {f"eval_{k[5:]}_{phase}": v for phase in ("before_rl", "after_rl")
                for k, v in self.sampled.get(phase, {}).items()}


async def evaluate_surviving_loss(busy: list[tuple[Any, list[int]]],
                                  evaluate: Callable[[Any, list[int]], Awaitable[Any]]) -> list[Any]:
    """Each (instance, prompt share) of ``busy`` evaluated; a share whose instance is lost
    meanwhile (fault.rollout_restarts: WorkerDiedError) is evaluated again on an instance that
    answered, so that an evaluation covers every held-out prompt whichever instance dies.
    Raises the first loss when no instance answered, and any other error as it is."""
    replies: list[Any] = list(await asyncio.gather(*(evaluate(inst, part) for inst, part in busy),
                                                   return_exceptions=True))
    gone = {id(busy[j][0]) for j, r in enumerate(replies) if isinstance(r, WorkerDiedError)}
    while True:
        for r in replies:
            if isinstance(r, BaseException) and not isinstance(r, WorkerDiedError):
                raise r
        lost = [j for j, r in enumerate(replies) if isinstance(r, WorkerDiedError)]
        if not lost:
            return replies
        answered = [inst for inst, _ in busy if id(inst) not in gone]
        if not answered:
            raise replies[lost[0]]
        log.warning("evaluation: %d share(s) of the held-out prompts were on a lost rollout instance; evaluating "
                    "them again on the %d that answered", len(lost), len(answered))
        on = [answered[n % len(answered)] for n in range(len(lost))]
        again = await asyncio.gather(*(evaluate(inst, busy[j][1]) for inst, j in zip(on, lost)),
                                     return_exceptions=True)
        for j, inst, r in zip(lost, on, again):
            replies[j] = r
            if isinstance(r, WorkerDiedError):
                gone.add(id(inst))


async def warmup(cfg: RunConfig, roles: RunRoles, data: RunData, logger: MetricsLogger, evaluate: Evaluator) -> int:
    """Supervised steps on the task's answers until the held-out check passes; returns the steps."""
    w = cfg.warmup
    if not w.enabled or data.sft_examples is None:
        return 0
    policy = roles.policy
    await policy.reset_optimizer("warmup")
    rng = random.Random(cfg.trainer.seed)
    step = 0
    while step < w.max_steps:
        for _ in range(min(w.check_every, w.max_steps - step)):
            batch = data.sft_examples(w.batch_size, rng)
            masks = [b[2] for b in batch] if len(batch[0]) > 2 else None  # tool text is not the model's
            m = (await policy.sft_step([b[0] for b in batch], [b[1] for b in batch], masks))[0]
            step += 1
            if step % 5 == 0:
                logger.log(step, {"sft/loss": float(m.get("loss", float("nan"))), "phase": "sft"})
        await sync_weights(roles, 0)
        if await evaluate(step, "sft") >= w.target_accuracy:
            break
    return step
