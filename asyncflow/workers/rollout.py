"""A rollout instance as a service: its engine runs on a thread of its own (``RolloutService``),
rows stream in and out request by request, and control calls (new weights, stats, abort,
new rows) are registered ``concurrent=True``, so they are served while
generation runs instead of waiting behind it.

Two ways in:
- ``submit`` (disaggregated placement): the executor hands over a BatchMeta whenever the
  instance has free slots; each row is written to the TransferQueue as soon as it finishes.
- ``generate`` (colocated placement): one call in the rank's call queue, so that colocated
  roles still take turns on the rank; the rows go through the same service.

Rows of a stage with the option ``score_into`` (``placement.reward_with=inline``) are scored
here with the run's rule reward as they finish and written with their scores.

Weights: ``receive_weights`` starts a background receive; ``swap_weights`` waits for it and
has the service swap the weights in at the next decode-step boundary (mid-generation with
``rollout.partial_rollout``, else once the running batch has drained).
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from .. import column_names as col
from ..agents.episode import EpisodeLimits
from ..agents.runner import EpisodeRunner, episode_columns, episode_rows, show_episode
from ..agents.serving.spec import endpoint_spec
from ..config import rollout_devices
from ..cpu_account import charged
from ..engines.rollout import SamplingParams
from ..engines.rollout.base import GenerationRequest, RequestEngine, RolloutEngine
from ..engines.rollout.builtin import BuiltinRolloutEngine
from ..engines.rollout.columns import ROLLOUT_OUTPUTS, result_columns
from ..engines.rollout.service import RolloutService
from ..engines.rollout.vllm_args import cpu_bind, kv_cache_bytes, usable_cores
from ..engines.rollout.vllm_lora import LoraSpec
from ..models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from ..rewards.runner import RewardRunner, extra_means
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta
from ..workflow.stages import StageIO
from .common import EngineOffload, resolved_of, setup_rank
from .reward import RowScorer, reward_kwargs
from .rollout_stream import ROLLOUT_INPUTS, RowStream, ScoreContext, row_inputs, scored_columns, stage_params


def lora_scale(lora: Any) -> float | None:
    """The scale of the policy's LoRA updates (alpha / rank), None without LoRA."""
    return None if lora.rank is None else float(lora.alpha) / int(lora.rank)


class RolloutWorker(EngineOffload, Worker):
    def __init__(self, cfg: dict, sync_timeout_s: float = 300.0):
        run = resolved_of(cfg, self.platform.name)
        c = run.config
        setup_rank(run)
        r = c.rollout
        self.tokenizer = load_tokenizer(c.model.path)
        eos = eos_token_ids(c.model.path, self.tokenizer)
        self._reward_cfg, self._eos = c.reward, set(eos)
        self._scorer: Any = None  # a RowScorer, made when a stage first asks for scores
        self._scorer_lock = threading.Lock()
        if r.engine == "builtin":
            model = load_causal_lm(c.model.path, attn_implementation=c.model.attn_implementation or None,
                                   dtype=run.derived.rollout_dtype,
                                   device=str(self.device))
            self.engine = BuiltinRolloutEngine(model, eos_token_ids=eos, pad_token_id=self.tokenizer.pad_token_id,
                                               device=self.device, max_running_rows=r.max_running_rows,
                                               max_kv_tokens=r.max_kv_tokens, prefill_chunk=r.prefill_chunk,
                                               lora_scale=lora_scale(c.model.lora))
        elif r.engine == "vllm":
            self.engine = self._vllm_engine(run)
        else:
            raise ValueError(f"rollout worker rank {self.rank}: unknown engine {r.engine!r} (builtin | vllm)")
        self.engine.version = 0
        self.params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                     top_k=r.top_k, ignore_eos=r.ignore_eos)
        self.service = RolloutService(self.engine, name=f"rollout-rank{self.rank}", in_flight=r.partial_rollout,
                                      swap_mode=r.swap_mode)
        self.stream = RowStream(self.service, lambda: self.tq, self.params,
                                capacity=r.max_running_rows + max(1, r.max_running_rows // 4),
                                version=lambda: int(self.engine.version), name=f"rollout-rank{self.rank}",
                                linger_s=r.write_linger_s)
        # multi-turn episodes (a stage option "episode"): run on their own loop, turns through the service
        self.episodes = EpisodeRunner(self.service, self.tokenizer,
                                      EpisodeLimits(c.agent.max_turns, c.agent.max_tokens, c.agent.max_time_s),
                                      name=f"rollout-rank{self.rank}", endpoint=endpoint_spec(c, self.rank))
        self.stream.episodes = self.episodes
        self.stream.scorer = self.scorer
        self._eval_runners: dict[tuple, Any] = {}  # (reward, timeout, on_error) -> RewardRunner: one thread each
        self._call_ids = itertools.count()  # ids of generate/evaluate calls (atomic next() across threads)
        self.intake: Any = None  # how versions come in (weight_sync/intake.py), chosen by init_weight_sync
        self.sync_cfg = c.weight_sync
        # vLLM's workers join the weight-sync groups themselves (vllm_worker.py)
        self._engine_receives = r.engine == "vllm"
        self.sync_timeout_s = sync_timeout_s
        self.seq = 0  # publish counter of the weights held
        # colocated placement: free the device while other roles run (vLLM: only where it can sleep)
        self.start_idle(run.derived.offload_idle and bool(getattr(self.engine, "enable_sleep_mode", True)))

    def _vllm_engine(self, run: Any) -> Any:
        """The vLLM instance of this rank: the run's rollout dtype, its devices (tensor parallel
        over several), on CPU its share of the node's cores, and rollout.engine_kwargs."""
        # the vLLM backend only; slow: both import torch.distributed.tensor, and the driver imports this module
        # to check the recipe
        from ..engines.rollout.vllm import VLLMRolloutEngine
        from ..weight_sync.protocol import torch_dtype
        c, derived = run.config, run.derived
        r = c.rollout
        extra = dict(r.engine_kwargs)
        tp = extra.pop("tensor_parallel_size", None)
        # pinned to placement.rollout_devices (tensor parallel over several), else to this rank's device
        devices = rollout_devices(c, self.rank)
        if devices is None and self.device.type == "cuda" and self.device.index is not None and tp in (None, 1):
            devices = [self.device.index]
        bind = None
        if self.device.type == "cpu":
            local = int(os.environ.get("LOCAL_RANK", self.rank))
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or c.trainer.nproc
            bind = cpu_bind(usable_cores(), local, per_node, derived.rank_threads, int(tp or 1))
            if "kv_cache_memory_bytes" not in extra:
                hf = json.loads((Path(c.model.path) / "config.json").read_text())
                longest = int(extra.get("max_model_len") or hf.get("max_position_embeddings") or 4096)
                extra["kv_cache_memory_bytes"] = kv_cache_bytes(
                    hf, max_rows=r.max_running_rows, max_len=longest,
                    dtype_bytes=torch_dtype(derived.rollout_dtype).itemsize)
        lo = c.model.lora  # adapters through vLLM's LoRA support, else the merged weights (plain weights)
        lora = LoraSpec(int(lo.rank), float(lo.alpha)) if lo.rank is not None and lo.vllm == "adapters" else None
        return VLLMRolloutEngine(c.model.path, devices=devices, tensor_parallel_size=tp, lora=lora,
                                 gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_running_rows,
                                 dtype=derived.rollout_dtype, seed=c.trainer.seed,
                                 enable_sleep_mode=None if derived.offload_idle else False, cpu_bind=bind, **extra)

    def teardown(self) -> None:
        """Stop the episodes' loop (and endpoint), the service thread, then the engine's own processes."""
        self.episodes.close()
        self.service.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ---- colocation --------------------------------------------------------------------------
    def _free_engine(self) -> None:
        """The engine's generation memory (the builtin engine's cache buffers, and on an
        accelerator its weights to host; vLLM's sleep). Weights are kept: swaps still work."""
        self.service.call(lambda e: _generator(e).release_memory(), self.sync_timeout_s, "release_memory")

    def _restore_engine(self) -> None:
        self.service.call(lambda e: _generator(e).resume_memory(), self.sync_timeout_s, "resume_memory")

    # ---- weights in --------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def weight_endpoints(self, train_ranks: list[int]) -> int:
        """How many members this instance adds to each weight-sync group: none when a training
        rank shares its process (it gets the tensors in process), else one."""
        if self.rank in train_ranks:
            return 0
        return self.engine.weight_endpoints() if self._engine_receives else 1

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, train_ranks: list[int], addrs: list, index: int) -> None:
        """Receive from the training ranks ``train_ranks``: in process when this rank is one of
        them (colocated), else by joining each one's group (``addrs``, from the actor's
        ``open_weight_sync``) as member ``index``; returns once every group is complete. The
        way versions come in is chosen here, once (weight_sync/intake.py)."""
        # slow: weight_sync imports torch.distributed.tensor, and the driver imports this module to check the recipe
        from ..weight_sync.intake import IntakeContext, choose_intake

        w = self.sync_cfg
        ctx = IntakeContext(self.service, self.engine, self.rank, self.role, self.device, w.timeout_s,
                            self.sync_timeout_s)
        # vLLM's workers receive on their own, unless a training rank shares this process (in process then)
        self.intake = choose_intake(w.load, self._engine_receives and self.rank not in train_ranks, ctx)
        self.intake.connect(train_ranks, addrs, index)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def receive_weights(self, version: int) -> None:
        """Start receiving ``version`` in the background (before the actor publishes it; an
        instance in an actor's process gets it during the publish instead)."""
        self._intake("receive_weights").receive(version)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def swap_weights(self, version: int) -> dict:
        """Wait for ``version`` to arrive; staged, have the service swap it in at the next step
        boundary. Returns when it is in, with the pause it cost generation."""
        return self._held(self._intake("swap_weights").swap(version, self.seq), version)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def take_weights(self, version: int) -> dict:
        """``receive_weights`` and ``swap_weights`` in one call, made while the actor publishes
        ``version`` (an instance of the first swap wave: one request a version instead of two).
        Returns what swap_weights returns."""
        return self._held(self._intake("take_weights").take(version, self.seq), version)

    def _held(self, got: Any, version: int) -> dict:
        """The report of a swap (``got``: the intake's Swapped), its publish counter now held; or,
        with nothing newer swapped in, what _no_newer says."""
        if got is None:
            return self._no_newer(version)
        self.seq = got.seq
        report: dict = got.report
        return report

    def _intake(self, what: str) -> Any:
        if self.intake is None:
            raise RuntimeError(f"rollout rank {self.rank}: {what} before init_weight_sync")
        return self.intake

    def _no_newer(self, version: int) -> dict:
        if self.engine.version >= version:
            return {"version": int(self.engine.version), "pause_s": 0.0}
        raise RuntimeError(f"rollout rank {self.rank}: asked to swap in version {version}, but no newer "
                           f"weights arrived (holding {self.engine.version})")

    def scorer(self) -> Any:
        """The rule reward of ``score_into`` stages (one RowScorer, made on first use)."""
        with self._scorer_lock:
            if self._scorer is None:
                self._scorer = RowScorer(self._reward_cfg, self.tokenizer, self._eos)
            return self._scorer

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def reward_stats(self) -> dict:
        """Scoring calls of ``score_into`` stages that raised or timed out so far."""
        s = self._scorer
        return s.stats() if s is not None else {"reward/errors": 0, "reward/timeouts": 0}

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def version(self) -> int:
        return int(self.engine.version)

    # ---- rows in, rows out -------------------------------------------------------------------
    @register(Dispatch.RANK_ZERO, concurrent=True)
    @charged("rollout_submit")
    def submit(self, meta: BatchMeta | None, min_version: int, want_free: int = 1, wait_s: float = 30.0,
               io: StageIO | dict[str, Any] | None = None) -> dict:
        """Queue the meta's rows (each admitted once the weights held are at least ``min_version``;
        None: queue nothing, only wait and report) for the stage ``io``; return once ``want_free``
        more rows fit, with what was written to the TransferQueue since the last report (rows and
        engine seconds per partition)."""
        if meta is not None:
            self.stream.submit(meta, min_version, StageIO.of(io, ROLLOUT_INPUTS, ROLLOUT_OUTPUTS))
        return self.stream.wait_capacity(want_free, wait_s)

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def capacity(self) -> int:
        return self.stream.capacity

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def drain(self, timeout_s: float = 600.0) -> int:
        """Wait until every submitted row is written; return the rows written so far."""
        self.stream.drain(timeout_s)
        return self.stream.rows_written

    @register(Dispatch.DP_COMPUTE, columns=True)  # reads rows and values only: no TensorDict built
    def generate(self, data: Any, min_version: int, io: StageIO | dict[str, Any] | None = None) -> dict:
        """All rows of one call, through the service (the colocated path: the call holds the rank)."""
        stage = StageIO.of(io, ROLLOUT_INPUTS, ROLLOUT_OUTPUTS)
        if stage.options.get("episode"):
            return self._run_episodes(data, min_version, stage)
        prompts, seeds, budgets = row_inputs(data, stage.inputs)
        params = stage_params(self.params, stage.options)
        # one_per_group: rows of a group share their prompt, so one response per distinct prompt
        # (the data of a call carries no group ids)
        pick = list(range(len(prompts)))
        if stage.options.get("one_per_group"):
            first: dict[tuple, int] = {}
            pick = [first.setdefault(tuple(p.tolist()), i) for i, p in enumerate(prompts)]
        lead = sorted(set(pick))
        done = self._run_requests([prompts[i] for i in lead], [seeds[i] for i in lead], [budgets[i] for i in lead],
                                  params, min_version, "generate")
        by_lead = dict(zip(lead, done))
        results = [by_lead[i] for i in pick]
        for r in results:
            if r.finish_reason == "error":
                raise ValueError(f"rollout rank {self.rank}: a row was refused: {r.error}")
        score_into = stage.options.get("score_into")
        context = ScoreContext.of(data, len(results), f"rollout rank {self.rank}") if score_into else None
        return scored_columns(result_columns, results, int(self.engine.version), stage.outputs, score_into,
                              self.scorer() if score_into else None, context)

    def _run_episodes(self, data: Any, min_version: int, io: StageIO) -> dict:
        """One episode per row of the call; the columns of their trajectories."""
        n = len(data[io.inputs[0]])
        rows = episode_rows(data, n)
        params = stage_params(self.params, {k: v for k, v in io.options.items() if k != "episode"})
        call = next(self._call_ids)
        futs = [self.episodes.start(io.options["episode"], row, params, int(min_version), ("episode", call, i))
                for i, row in enumerate(rows)]
        trajs = [f.result(self.sync_timeout_s) for f in futs]
        for t in trajs:
            if t.finish_reason == "error":
                raise RuntimeError(f"rollout rank {self.rank}: {t.error}")
        return episode_columns(trajs, int(self.engine.version), io.outputs)

    def _run_requests(self, prompts: list[torch.Tensor], seeds: list[int], budgets: list, params: Any,
                      min_version: int, tag: str) -> list:
        """Generate every prompt (``params``: one SamplingParams for all, or a list, one each)."""
        call = next(self._call_ids)
        each = params if isinstance(params, list) else [params] * len(prompts)
        futs = [self.service.submit(GenerationRequest((tag, call, i), p, q, s, b, int(min_version)))
                for i, (p, q, s, b) in enumerate(zip(prompts, each, seeds, budgets))]
        return [f.result(self.sync_timeout_s) for f in futs]

    @register(Dispatch.RANK_ZERO, concurrent=True)
    def abort(self, request_ids: list) -> int:
        """Abort requests by id (unknown ids are counted no-ops); return how many were known."""
        return sum(bool(self.service.abort(tuple(r) if isinstance(r, list) else r)) for r in request_ids)

    # In the call queue, not concurrent: colocated, the rollout role must be onloaded to run it;
    # apart from other roles, the queue is free while the service generates, so it runs at once.
    @register(Dispatch.RANK_ZERO)
    def evaluate(self, prompts: list[list[int]], answers: list[str], reward: str = "number",
                 max_new_tokens: int = 8, samples: int = 4, timeout_s: float = 10.0,
                 on_error: Literal["zero", "fail"] = "zero", extra: list[dict] | None = None, episode: str = "",
                 n_samples: int = 0, temperature: float = 1.0, seeds: list[int] | None = None) -> dict:
        """Greedy accuracy on held-out prompts with the weights held now (its rows join the
        running batch). The reward runs under the same per-call timeout and error policy as in
        training, with each prompt's ``extra`` keywords (its text and record metadata). With
        ``episode``, each prompt is a greedy episode scored by its own reward.

        With ``n_samples`` > 0, also that many responses (or episodes) per prompt sampled at
        ``temperature``, generated beside the greedy ones; the j-th of prompt i is seeded
        ``seeds[i] + j`` (the caller's: a prompt draws the same samples on any instance).
        ``correct`` counts each prompt's samples scoring >= 1 (a rule reward's full mark),
        ``sample_score_sums`` adds up their scores; ``samples`` is the number of greedy examples shown."""
        start = time.monotonic()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature) if n_samples else None
        firsts = list(seeds) if seeds is not None else [i * max(n_samples, 1) for i in range(len(prompts))]
        draws = [(i, firsts[i] + j) for i in range(len(prompts)) for j in range(n_samples)]  # (prompt, seed)
        version = int(self.engine.version)
        if episode:
            return self._evaluate_episodes(prompts, answers, extra, params, episode, samples, start, sampled, draws)
        tensors = [torch.tensor(p, dtype=torch.long) for p in prompts]
        results = self._run_requests(tensors + [tensors[i] for i, _ in draws],
                                     list(range(len(prompts))) + [s for _, s in draws],
                                     [None] * (len(prompts) + len(draws)),
                                     [params] * len(prompts) + [sampled] * len(draws), version, "eval")
        texts = self.tokenizer.batch_decode([r.response_ids.tolist() for r in results], skip_special_tokens=True)
        key = (reward, timeout_s, on_error)
        if key not in self._eval_runners:
            self._eval_runners[key] = RewardRunner(reward, timeout_s=timeout_s, on_error=on_error)
        runner = self._eval_runners[key]
        extra = list(extra) if extra is not None else [{} for _ in prompts]
        n = len(prompts)
        scores, stats = runner.score(texts[:n], answers, reward_kwargs(runner.fn, extra))
        out = {"accuracy": sum(scores) / max(len(scores), 1), "version": version, "scores": list(scores),
               "reward_errors": stats["errors"], "reward_timeouts": stats["timeouts"],
               "reward_extra": extra_means(stats["extra"])}
        if draws:
            drawn, more = runner.score(texts[n:], [answers[i] for i, _ in draws],
                                       reward_kwargs(runner.fn, [extra[i] for i, _ in draws]))
            out.update(self._sample_figures(n, draws, drawn))
            out["reward_errors"] += more["errors"]
            out["reward_timeouts"] += more["timeouts"]
        out["examples"] = [{"prompt": self.tokenizer.decode(prompts[i]), "response": texts[i], "answer": answers[i]}
                           for i in range(min(samples, n))]
        out["eval_s"] = time.monotonic() - start
        return out

    @staticmethod
    def _sample_figures(prompts: int, draws: list[tuple[int, int]], scores: list[float]) -> dict[str, list]:
        """Per prompt: its correct samples (score >= 1) and the sum of its samples' scores."""
        correct, sums = [0] * prompts, [0.0] * prompts
        for (i, _), score in zip(draws, scores):
            correct[i] += int(float(score) >= 1.0)
            sums[i] += float(score)
        return {"correct": correct, "sample_score_sums": sums}

    def _evaluate_episodes(self, prompts: list[list[int]], answers: list[str], extra: list[dict] | None,
                           params: Any, episode: str, samples: int, start: float, sampled: Any = None,
                           draws: Sequence[tuple[int, int]] = ()) -> dict:
        version = int(self.engine.version)
        extra = list(extra) if extra is not None else [{} for _ in prompts]
        # the same shape as a training row: prompt text, answer, seed and the record's metadata
        rows = [{col.PROMPT_IDS: list(p), col.ANSWER: a, col.SEED: i, col.PROMPT: e.get("prompt", ""),
                 col.METADATA: {k: v for k, v in e.items() if k != "prompt"}}
                for i, (p, a, e) in enumerate(zip(prompts, answers, extra))]
        call = next(self._call_ids)
        futs = [self.episodes.start(episode, row, params, version, ("eval-episode", call, i), count=False)
                for i, row in enumerate(rows)]
        futs += [self.episodes.start(episode, {**rows[i], col.SEED: seed}, sampled, version,
                                     ("eval-episode-sample", call, k), count=False)
                 for k, (i, seed) in enumerate(draws)]
        every = [f.result(self.sync_timeout_s) for f in futs]
        for t in every:
            if t.finish_reason == "error":
                raise RuntimeError(f"rollout rank {self.rank}: evaluation {t.error}")
        trajs = every[:len(rows)]
        shown = [{"prompt": self.tokenizer.decode(prompts[i]), "answer": answers[i],
                  "response": show_episode(self.tokenizer, trajs[i])} for i in range(min(samples, len(prompts)))]
        n = max(len(trajs), 1)
        out = {"accuracy": sum(t.reward for t in trajs) / n, "version": version, "scores": [t.reward for t in trajs],
               "eval_s": time.monotonic() - start, "examples": shown, "reward_errors": 0, "reward_timeouts": 0,
               "turns_mean": sum(t.metrics.get("turns", 0) for t in trajs) / n,
               "tool_calls_per_episode": sum(t.metrics.get("tool_calls", 0) for t in trajs) / n}
        if draws:
            out.update(self._sample_figures(len(rows), list(draws), [t.reward for t in every[len(rows):]]))
        return out

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    def stats(self) -> dict:
        s = self.service.stats(self.sync_timeout_s)
        return {**s, "aborts": s.get("aborted", 0), "rows_written": self.stream.rows_written,
                "episodes": self.episodes.snapshot()}


def _generator(engine: RequestEngine) -> RolloutEngine:
    """The instance's engine as the generator it also is (both engines are): the one that
    frees and restores its memory."""
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"{type(engine).__name__} cannot release its memory (it is no RolloutEngine)")
    return engine
