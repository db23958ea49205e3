"""The reward role: decodes responses and scores them with a rule from the registry.

A reward function is called as ``fn(response, answer, prompt=..., **metadata)`` when its
stage reads the ``prompt`` and ``metadata`` columns (the prompt text and the data record's
other fields); keywords the function does not take are left out. The reward is ``reward.name``,
or with ``reward.custom_path`` a verl-style function from that file (asyncflow.rewards.custom).
"""
from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from .. import column_names as col
from ..cpu_account import charged
from ..models.loading import eos_token_ids, load_tokenizer
from ..rewards.custom import reward_ref
from ..rewards.runner import RewardRunner
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.row_lists import rows, values
from ..workflow.stages import StageIO
from .common import resolved_of, setup_rank


def reward_kwargs(fn: Any, extra: list[dict]) -> list[dict]:
    """Each row's keyword arguments for ``fn``: those of ``extra`` it takes (all with ``**kwargs``)."""
    takes = _accepted(fn)
    return extra if takes is None else [{k: v for k, v in e.items() if k in takes} for e in extra]


def _accepted(fn: Any) -> set[str] | None:
    """The keyword names ``fn`` takes; None when it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class RowScorer:
    """A rule reward over token responses: each response decoded up to its first EOS and scored
    with its answer and, where given, its prompt text and its record's metadata. The reward
    stage's worker and a rollout instance scoring its own rows (``placement.reward_with=inline``)
    both score through it, so the two give the same scores."""

    def __init__(self, reward: Any, tokenizer: Any, eos: set[int]):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # one RewardRunner: a call at a time (writer thread, call queue)
        self.eos = set(eos)
        self.runner = RewardRunner(reward_ref(reward), timeout_s=reward.timeout_s, on_error=reward.on_error)
        self.errors = 0
        self.timeouts = 0
        self.extra: dict[str, list[float]] = {}  # key -> [sum, rows] of dict results' extras, over the run

    def score(self, responses: list[torch.Tensor], answers: list, prompts: list | None = None,
              metadata: list | None = None) -> torch.Tensor:
        texts = self.tokenizer.batch_decode([self._to_first_eos(r.tolist()) for r in responses],
                                            skip_special_tokens=True)
        extra: list[dict] = [{} for _ in texts]
        for e, p in zip(extra, prompts or ()):
            e["prompt"] = p
        for e, m in zip(extra, metadata or ()):
            e.update({k: v for k, v in dict(m or {}).items() if k != "prompt"})
        with self._lock:
            scores, stats = self.runner.score(texts, [str(a) for a in answers], reward_kwargs(self.runner.fn, extra))
            self.errors += int(stats.get("errors", 0))
            self.timeouts += int(stats.get("timeouts", 0))
            for k, (total, n) in stats.get("extra", {}).items():
                acc = self.extra.setdefault(k, [0.0, 0])
                acc[0] += total
                acc[1] += n
        return torch.tensor(scores, dtype=torch.float32)

    def _to_first_eos(self, ids: list[int]) -> list[int]:
        """A response ends at its first EOS (any of the rollout's): with rollout.ignore_eos a row
        runs on past it, and what follows is not the answer."""
        end = next((i for i, t in enumerate(ids) if t in self.eos), None)
        return ids if end is None else ids[:end + 1]

    def stats(self) -> dict:
        """Failures so far, and under "reward/extra" the extras' {key: [sum, rows]} so far."""
        return {"reward/errors": self.errors, "reward/timeouts": self.timeouts,
                "reward/extra": {k: list(v) for k, v in self.extra.items()}}


class RewardWorker(Worker):
    needs_device = False  # a rule over decoded text: the roles beside it stay loaded

    def __init__(self, cfg: dict):
        run = resolved_of(cfg)  # (a rule over text: the platform-dependent values are not read here)
        c = run.config
        setup_rank(run)
        tokenizer = load_tokenizer(c.model.path)
        self.scorer = RowScorer(c.reward, tokenizer, set(eos_token_ids(c.model.path, tokenizer)))

    @register(Dispatch.DP_COMPUTE, columns=True)  # reads values only: no TensorDict built
    @charged("reward")
    def compute(self, data: Any, io: StageIO | dict[str, Any] | None = None) -> dict:
        """[response, answer, and optionally prompt, metadata] -> one score per row."""
        stage = StageIO.of(io, [col.RESPONSE_IDS, col.ANSWER], [col.SCORES])
        return {stage.outputs[0]: self.scorer.score(
            rows(data[stage.inputs[0]]), values(data[stage.inputs[1]]),
            values(data[col.PROMPT]) if col.PROMPT in stage.inputs else None,
            values(data[col.METADATA]) if col.METADATA in stage.inputs else None)}

    @register(Dispatch.ONE_TO_ALL)
    def reward_stats(self) -> dict:
        """Reward calls that raised or timed out so far (the trainer sums every role that has this)."""
        return self.scorer.stats()
