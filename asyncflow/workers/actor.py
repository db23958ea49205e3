"""The actor: trains the policy (and recomputes proximal log-probs); publishes its weights.

The update reads only this rank's data-parallel share of the step: the ranks of the group
ask the TransferQueue together (the first to ask samples for all, token-balanced by
Karmarkar-Karp so that no rank waits for the one with the longest sequences) and each takes
its part. Advantages come precomputed in a column (the recipe's advantage stage).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import column_names as col
from ..cpu_account import charged
from ..engines.train.lora import LoraOptions, hf_name, is_adapter, merged_tensors
from ..models.loading import load_tokenizer
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta
from ..transfer_queue.row_lists import tensor, values
from ..weight_sync.wire_group import WireGroup, open_store
from ..workflow.stages import StageIO
from ..workflow.update_request import UpdateRequest
from .actor_loss import RolloutCorr, policy_loss_fn, sft_loss_fn
from .common import (
    EngineCheckpoints,
    EngineOffload,
    engine_optim,
    per_token_column,
    policy_model,
    resolved_of,
    rows,
    setup_rank,
    train_engine_class,
)

if TYPE_CHECKING:  # imported where the group is opened
    from ..weight_sync.wire_group import WireAddress

log = logging.getLogger(__name__)

UPDATE_INPUTS = [col.PROMPT_IDS, col.RESPONSE_IDS, col.ADVANTAGES, col.BEHAV_LOG_PROBS, col.SCORES, col.GEN_VERSION]
PER_TOKEN = (col.ADVANTAGES, col.BEHAV_LOG_PROBS, col.OLD_LOG_PROBS, col.REF_LOG_PROBS)


def _share(n: int, dp_rank: int, dp_size: int) -> range:
    q, r = divmod(n, dp_size)
    start = dp_rank * q + min(dp_rank, r)
    return range(start, start + q + (1 if dp_rank < r else 0))


def split_even(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return [[items[i] for i in _share(len(items), k, parts)] for k in range(parts)]


class ActorWorker(EngineCheckpoints, EngineOffload, Worker):
    def __init__(self, cfg: dict, optim: str = "optim"):
        self.resolved = run = resolved_of(cfg, self.platform.name)
        self.cfg = c = run.config
        setup_rank(run)
        torch.manual_seed(c.trainer.seed + self.rank)
        self.optim_key = optim
        self.temperature = c.rollout.temperature
        self.algo = dataclasses.replace(c.algorithm, policy_loss=run.derived.policy_loss)
        lora = LoraOptions.from_model_config(c.model)  # None: every weight trains
        self.engine = train_engine_class(c.model.train_engine)(
            policy_model(c), engine_optim(c, optim), process_group=self.process_group, platform=self.platform,
            **({"lora": lora} if lora is not None else {}))
        self.lora = lora
        # LoRA: the built-in engine takes the adapters; vLLM the adapters or merged weights (model.lora.vllm)
        self.lora_sync = "merged" if c.rollout.engine == "vllm" and c.model.lora.vllm == "merged" else "adapters"
        self._merged: Any = None  # the merged tensors of the last publish, alive while they are on the wire
        self.sender: Any = None  # a weight_sync.send.BucketSender once init_weight_sync ran
        # this rank's weight-sync group store and its address (open_weight_sync)
        self._ws_store: Any = None
        self._ws_addr: WireAddress | None = None
        self.published = 0
        self.start_idle(run.derived.offload_idle)  # colocated placement: free the device while other roles run

    # ---- optimisation ----------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def reset_optimizer(self, phase: str = "rl") -> None:
        """A fresh optimizer and schedule for ``phase``: "warmup" (supervised) or "rl". With LoRA
        the supervised warm-up trains the base (every weight; the adapters stay zero), standing
        in for the SFT checkpoint LoRA RL starts from; RL trains the adapters on that frozen
        base, which is also the reference (the policy RL starts from)."""
        if self.lora is not None:
            self.engine.train_part("base" if phase == "warmup" else "adapters")
        self.engine.reset_optimizer(engine_optim(self.cfg, self.optim_key, phase))

    @register(Dispatch.ONE_TO_ALL)
    def sft_step(self, prompts: list[list[int]], targets: list[list[int]],
                 masks: list[list[int]] | None = None) -> dict:
        """One supervised step on the global batch (each rank trains on its share).

        masks: optional, one 0/1 list per target and as long as it: 1 = train on this target
        token, 0 = not the model's (tool output in a multi-turn example). It becomes the
        engine's ``loss_mask`` field: the NLL and its token-mean count only the 1s."""
        if masks is not None and len(masks) != len(targets):
            raise ValueError(f"actor rank {self.rank}: sft_step got {len(masks)} masks for {len(targets)} targets")
        mine = _share(len(prompts), self.dp_rank, self.dp_size)
        p = [torch.tensor(prompts[i], dtype=torch.long) for i in mine]
        t = [torch.tensor(targets[i], dtype=torch.long) for i in mine]
        # the engine checks each mask's length and that it holds only 0/1
        fields = {} if masks is None else {col.LOSS_MASK: [torch.tensor(masks[i]).reshape(-1) for i in mine]}
        return self.engine.train_step(p, t, fields, sft_loss_fn, temperature=1.0)

    @register(Dispatch.ONE_TO_ALL)
    @charged("old_log_prob")
    def compute_log_probs(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> None:
        """Log-probs of the responses under the weights held now (proximal log-probs, the
        weights the next update starts from): [prompt, response] -> one per-token column."""
        per_token_column(self, meta, StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.OLD_LOG_PROBS]),
                         lambda p, r: self.engine.compute_log_probs(p, r, temperature=self.temperature)[0])

    @register(Dispatch.ONE_TO_ALL)
    @charged("ref_log_prob")
    def compute_ref_log_probs(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> None:
        """LoRA: the reference's log-probs, from this model with its adapters off (no second
        model): [prompt, response] -> one per-token column."""
        per_token_column(self, meta, StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.REF_LOG_PROBS]),
                         lambda p, r: self.engine.compute_log_probs(p, r, temperature=self.temperature,
                                                                    adapters=False)[0])

    @register(Dispatch.ONE_TO_ALL)
    @charged("update")
    def update(self, step: int, request: UpdateRequest | dict[str, Any],
               io: StageIO | dict[str, Any] | None = None) -> dict[str, float]:
        """The policy update of ``step`` on this rank's share of the step's ``request.rows`` rows
        (``request``: an UpdateRequest, or its wire dict): ``ppo_epochs`` passes, each one
        optimizer step per mini-batch. Returns the step's metrics (the same on every rank)."""
        req = UpdateRequest.from_wire(request)
        stage = StageIO.of(io, UPDATE_INPUTS, [])
        have = [c for c in (*PER_TOKEN, col.LOSS_MASK, col.PROMPT_IDS, col.RESPONSE_IDS, col.SCORES, col.GEN_VERSION,
                            col.TOKEN_VERSIONS) if c in stage.inputs]
        if col.ADVANTAGES not in have:
            raise ValueError(f"actor rank {self.rank}: the update stage must read an {col.ADVANTAGES!r} column "
                             f"(the recipe's advantage stage writes it); it reads {stage.inputs}")
        sampler = {"name": "token_balanced", "dp_size": self.dp_size}
        # The columns themselves (rows() and values() read them), not a TensorDict built to be taken apart
        if self.dp_size == 1:  # the whole step is this rank's: its rows and their data in one request
            meta, data = self.tq.get_batch_columns(
                stage.inputs, req.rows, req.task, req.partition, sampler, data_columns=have,
                timeout=req.timeout_s, dp_group=self.role, dp_rank=self.dp_rank, dp_size=self.dp_size)
            mine = meta
        else:  # every rank samples the same split, then reads only its own part
            meta = self.tq.get_meta(stage.inputs, req.rows, req.task, req.partition, sampler,
                                    timeout=req.timeout_s, dp_group=self.role, dp_rank=self.dp_rank,
                                    dp_size=self.dp_size)
            mine = meta.part(self.dp_size, self.dp_rank)
            data = self.tq.get_columns(mine, have) if len(mine) else None
        prompts = rows(data[col.PROMPT_IDS]) if data is not None else []
        responses = rows(data[col.RESPONSE_IDS]) if data is not None else []
        fields = {c: ([x.float() for x in rows(data[c])] if data is not None else []) for c in PER_TOKEN if c in have}
        if col.LOSS_MASK in have:  # multi-turn rows: 1 = model token; tool/env tokens get no gradient
            fields[col.LOSS_MASK] = rows(data[col.LOSS_MASK]) if data is not None else []  # engine checks 0/1
        if col.BEHAV_LOG_PROBS in fields:  # the version that sampled each token: rollout_corr's same-version figures
            if col.TOKEN_VERSIONS in have:
                fields[col.TOKEN_VERSIONS] = ([x.float() for x in rows(data[col.TOKEN_VERSIONS])]
                                              if data is not None else [])
            elif col.GEN_VERSION in have:  # a row's oldest token's version: only rows wholly of one version match
                fields[col.TOKEN_VERSIONS] = ([torch.full(r.shape, float(v)) for r, v in
                                             zip(responses, values(data[col.GEN_VERSION]))] if data is not None else [])
        metrics = self._train(step, meta, prompts, responses, fields)
        metrics.update(self._batch_stats(step, data, responses, prompts, fields.get(col.LOSS_MASK)))
        return metrics

    def _train(self, step: int, meta: BatchMeta, prompts: list, responses: list, fields: dict) -> dict:
        a = self.algo
        n_prompts = len(set(meta.groups)) if meta.groups else len(meta)
        per_epoch = 1 if a.ppo_mini_batch_size <= 0 else max(1, math.ceil(n_prompts / a.ppo_mini_batch_size))
        steps = a.ppo_epochs * per_epoch
        behav = col.BEHAV_LOG_PROBS in fields
        if (a.rollout_is or a.rollout_mask) and not behav:
            raise ValueError(f"actor rank {self.rank}: algorithm.rollout_is / rollout_mask ({a.rollout_is!r} / "
                             f"{a.rollout_mask!r}) need the behaviour log-probs: the update stage must read the "
                             f"behav_log_probs column")
        # Several optimizer steps: the ratio is against the weights the update starts from. A
        # rollout mask: the tokens it drops must be known before the loss's token counts.
        if (steps > 1 or (a.rollout_mask and behav)) and col.OLD_LOG_PROBS not in fields:
            fields[col.OLD_LOG_PROBS] = [x.float() for x in self.engine.compute_log_probs(
                prompts, responses, temperature=self.temperature)[0]]
        corr = RolloutCorr(a, version=step)  # the proximal log-probs are version `step`'s (update t: t -> t + 1)
        if behav and col.OLD_LOG_PROBS in fields:
            fields = corr.prepare(fields)  # a new dict: the caller's loss_mask stays the rows' own
        loss = policy_loss_fn(a, corr)
        rng = random.Random(self.cfg.trainer.seed * 1_000_003 + step)
        order = list(range(len(prompts)))
        results: list[dict] = []
        for _ in range(a.ppo_epochs):
            if per_epoch > 1:
                rng.shuffle(order)
            for part in split_even(order, per_epoch):
                results.append(self.engine.train_step(
                    [prompts[i] for i in part], [responses[i] for i in part],
                    {c: [v[i] for i in part] for c, v in fields.items()}, loss,
                    temperature=self.temperature, with_entropy=True))
        out: dict[str, float] = {}
        for k in results[0]:
            vals = [float(r[k]) for r in results if isinstance(r.get(k), (int, float))]
            if vals:
                key = k if "/" in k else f"actor/{k}"
                out[key] = vals[-1] if k == "lr" else sum(vals) / len(vals)
        out["actor/optimizer_steps"] = float(len(results))
        sums, maxes = corr.totals()
        if self.dp_size > 1:  # every rank has the same keys in the same order, rows or not
            dist.all_reduce(sums, group=self.process_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.process_group)
        out.update(corr.metrics(sums, maxes))
        return out

    def _batch_stats(self, step: int, data: Any, responses: list, prompts: list,
                     loss_masks: list | None = None) -> dict[str, float]:
        """Reward, length and staleness over the whole step (summed over the data-parallel ranks).

        Lengths and ``tokens`` count every response token, tool output included (what the
        rollout produced and the update's forward passes process); with a loss mask,
        ``response_model_tokens`` and ``response_model_length/mean`` count the model's own
        tokens (the trained ones: the engine's ``actor/tokens``)."""
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float64)
        model_tokens = float(sum(int((m != 0).sum()) for m in loss_masks)) if loss_masks else 0.0
        scores = tensor(data[col.SCORES]).double() if data is not None and col.SCORES in data.keys() else torch.zeros(0)
        stale = (step - tensor(data[col.GEN_VERSION]).double()) if data is not None and col.GEN_VERSION in data.keys() \
            else torch.zeros(0)
        inf = float("inf")
        sums = torch.tensor([float(len(responses)), float(lengths.sum()), float(sum(len(p) for p in prompts)),
                             float(scores.sum()), float(len(scores)), float(stale.sum()), float(len(stale)),
                             model_tokens], dtype=torch.float64)
        maxes = torch.tensor([float(scores.max()) if len(scores) else -inf, float(stale.max()) if len(stale) else -inf,
                              float(-scores.min()) if len(scores) else -inf], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(sums, group=self.process_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.process_group)
        n, resp_tokens, prompt_tokens, score_sum, n_scores, stale_sum, n_stale, model = sums.tolist()
        out = {"rows": n, "tokens": resp_tokens + prompt_tokens, "response_tokens": resp_tokens,
               "response_length/mean": resp_tokens / max(n, 1.0)}
        if loss_masks is not None:  # the same on every rank: whether the update stage reads a loss_mask
            out.update({"response_model_tokens": model, "response_model_length/mean": model / max(n, 1.0)})
        if n_scores:
            out.update({"reward/mean": score_sum / n_scores, "reward/max": float(maxes[0]),
                        "reward/min": -float(maxes[2])})
        if n_stale:
            out.update({"async/staleness_mean": stale_sum / n_stale, "async/staleness_max": float(maxes[1])})
        return out

    # ---- weights out -----------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def open_weight_sync(self, members: int) -> dict[str, Any] | None:
        """Host the store of this rank's weight-sync group of ``members`` (this rank and every
        receiving endpoint); return its address as a dict (None: no receiver over the wire)."""
        if members < 2:
            self._ws_store = self._ws_addr = None
            return None
        self._ws_store, self._ws_addr = open_store(members, self.platform.backend,
                                                   f"{self.role}-r{self.rank}-{time.time_ns()}",
                                                   self.cfg.weight_sync.timeout_s)
        return self._ws_addr.to_dict()

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, gather_all: bool) -> None:
        """Join this rank's group (member 0; returns once every receiver has joined). An
        instance in this rank's process gets the tensors in process instead; ``gather_all``:
        some training rank has one, so every rank gathers every tensor whole."""
        # slow: weight_sync imports torch.distributed.tensor, and the driver imports this module to check the recipe
        from ..weight_sync.protocol import torch_dtype
        from ..weight_sync.send import BucketSender
        from ..weight_sync.sinks import local_sinks

        w = self.cfg.weight_sync
        if self.sender is not None:  # groups made again around a lost (or new) rollout instance
            self._drop_sender()
        group = None
        if self._ws_addr is not None:
            group = WireGroup(self._ws_addr, 0, w.timeout_s, device=self.device, store=self._ws_store)
        self.sender = BucketSender(self.rank, self.group_rank, group, local_sinks, timeout_s=w.timeout_s,
                                   max_inflight=w.max_inflight, role=self.role, train_ranks=list(self.layout.ranks),
                                   gather_all=bool(gather_all))
        self.sync_dtype = torch_dtype(self.resolved.derived.rollout_dtype)
        self.bucket_bytes = int(w.bucket_mb * 2**20)
        # An engine that says before writing its parameters lets publish return before the
        # receivers have read them: the next update overlaps the transfer.
        self._defer_sync = bool(getattr(self.engine, "guards_weight_writes", False))
        if self._defer_sync:
            self.engine.before_weights_change = (self._settle_or_note if self.cfg.fault.rollout_restarts
                                                 else self.sender.settle)

    def _settle_or_note(self) -> None:
        """Lost rollout instances are replaced (fault.rollout_restarts): the last version not
        reaching every receiver does not fail the update that is about to change the weights;
        the sender refuses the next publish, and the driver makes the groups again without the
        lost instance (or, if none was lost, the run stops there)."""
        try:
            self.sender.settle()
        except Exception as e:  # noqa: BLE001 - noted: the next publish raises it
            log.warning("actor rank %d: %s; the next publish fails unless the groups are made again", self.rank, e)

    def _drop_sender(self) -> None:
        """Before new weight-sync groups: what the old ones still have on the wire is waited for
        briefly, never failing (a lost receiver is why they are made again); with LoRA the next
        version carries the base weights too (a new instance has only the model's own)."""
        try:
            self.sender.settle(timeout_s=min(5.0, self.sender.timeout_s))
        except Exception as e:  # noqa: BLE001 - the old groups are given up
            log.warning("actor rank %d: the old weight-sync groups are dropped unsettled: %s", self.rank, e)
        if self.lora is not None and hasattr(self.engine, "base_changed"):
            self.engine.base_changed = True
        self.sender = None

    @register(Dispatch.ONE_TO_ALL)
    @charged("weight_sync")
    def publish_weights(self, version: int) -> dict:
        """Send ``version`` to every rollout instance (all actor ranks, bucket by bucket; the
        receivers must be receiving: ``receive_weights`` first). Returns when this rank's
        buckets are posted; the engine's next write of the parameters (optimizer step,
        offload, loading) first waits until the receivers have them, and so does the next
        publish."""
        # slow: weight_sync imports torch.distributed.tensor, and the driver imports this module to check the recipe
        from ..weight_sync.protocol import make_header
        from ..weight_sync.shards import local_tensors

        if self.sender is None:
            raise RuntimeError(f"actor rank {self.rank}: publish_weights before init_weight_sync")
        start = time.monotonic()
        self.published += 1
        named = self._sync_tensors(local_tensors(self.engine.model))
        header = make_header(named, version, self.published, self.bucket_bytes, self.group_size, self.sync_dtype)
        stats = self.sender.send(header, named, wait_direct=not self._defer_sync)
        return {"bytes": header.nbytes, "bytes_sent": stats.bytes_sent, "buckets": len(header.buckets),
                "peak_extra_bytes": stats.peak_extra_bytes, "publish_s": time.monotonic() - start,
                "tensors": len(header.specs)}

    def _sync_tensors(self, named: list) -> list:
        """What a version sends. Full fine-tuning: every tensor. LoRA to the built-in engine:
        the adapters under the HF names (``<layer>.lora_A.weight``), with the base weights too
        when they changed since the last sync (the first sync, a fold, a loaded checkpoint); to
        vLLM: the merged weights, built here (lora.merged_tensors)."""
        if self.lora is None:
            return named
        if self.lora_sync == "merged":
            self._merged = merged_tensors(self.engine.model, named, self.lora.scale)
            return self._merged
        full = self.engine.base_changed
        self.engine.base_changed = False
        return [(hf_name(k), v) for k, v in named if full or is_adapter(k)]

    def teardown(self) -> None:
        """At shutdown: the last version's messages still on the wire arrive before the process
        ends (bounded: a receiver that is gone must not hold the exit)."""
        if self.sender is not None:
            self.sender.settle(timeout_s=min(10.0, self.sender.timeout_s))

    # ---- export ----------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        self.engine.export_hf(path, tokenizer=load_tokenizer(self.cfg.model.path))

    @register(Dispatch.ONE_TO_ALL)
    def step_count(self) -> int:
        return int(self.engine.step)
