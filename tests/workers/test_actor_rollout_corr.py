"""ActorWorker.update with the rollout correction on a real (tiny) FSDP engine: the rollout_corr/
metrics come back with the step's metrics, and a rollout_mask trains exactly as the engine's
loss mask of the kept tokens would (the dropped tokens leave the loss and its token count)."""
from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from asyncflow.config import AlgorithmConfig
from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.transfer_queue.columns import to_column
from asyncflow.workers.actor_loss import policy_loss_fn
from tests.engines._train_helpers import make_batch, tiny_model
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse

STEP = 5  # update 5 trains version 5: tokens sampled by version 5 are "the same weights"


def _engine() -> FSDPEngine:
    return FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, micro_batch_tokens=24, grad_clip=0.0))


class _Queue:
    """Just enough TransferQueue for one rank's update: every row, these columns."""

    class Meta(list):
        groups: list

    def __init__(self, columns: dict) -> None:
        self.columns = columns

    def get_batch_columns(self, columns, *args, data_columns=None, **kwargs):  # what a one-rank update reads
        meta = self.Meta(range(len(self.columns["response_ids"])))
        meta.groups = list(range(len(meta)))
        return meta, {c: to_column(c, self.columns[c]) for c in data_columns}  # Columns, as the client's


def _actor(engine, queue, algo):
    from asyncflow.workers.actor import ActorWorker

    class Bare(ActorWorker):
        rank, dp_rank, dp_size, role, process_group, tq = 0, 0, 1, "actor", None, None

        def __init__(self):
            self.engine, self.tq, self.temperature, self.algo = engine, queue, 1.0, algo
            self.cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(seed=0))
    return Bare()


def _ratios(n: int) -> torch.Tensor:
    """exp(old - behav) per token: 1.1 mostly, every 4th 3.0 and every 7th 0.3 (outside [0.5, 2])."""
    r = torch.full((n,), 1.1)
    r[::4] = 3.0
    r[3::7] = 0.3
    return r


def test_update_reports_rollout_corr_and_masks_like_the_engines_loss_mask() -> None:
    prompts, responses, fields = make_batch(6, seed=41, max_response=10)
    old = _engine().compute_log_probs(prompts, responses)[0]  # what the update will compute (same weights)
    ratios = [_ratios(r.numel()) for r in responses]
    behav = [o - torch.log(x) for o, x in zip(old, ratios)]
    versions = [torch.tensor([STEP - (j % 2) for j in range(r.numel())]) for r in responses]
    columns = {"prompt_ids": prompts, "response_ids": responses, "advantages": fields["advantages"],
               "behav_log_probs": behav, "token_versions": versions, "scores": torch.zeros(6),
               "gen_version": torch.full((6,), STEP - 1)}
    io = {"inputs": ["prompt_ids", "response_ids", "advantages", "behav_log_probs", "scores", "gen_version",
                     "token_versions"], "outputs": []}
    batch = {"rows": 6, "task": "update", "partition": "p", "timeout_s": 1.0}
    algo = AlgorithmConfig(policy_loss="ppo_clip", rollout_mask="token")
    got = _actor(_engine(), _Queue(columns), algo).update(STEP, batch, io)

    keep = [((x >= 0.5) & (x <= 2.0)).to(torch.int8) for x in ratios]
    n_all, n_kept = sum(r.numel() for r in responses), sum(int(k.sum()) for k in keep)
    assert 0 < n_kept < n_all
    direct = _engine().train_step(prompts, responses, {"advantages": fields["advantages"], "old_log_probs": old,
                                                       "loss_mask": keep},
                                  policy_loss_fn(dataclasses.replace(algo, rollout_mask="")), with_entropy=True)
    assert got["actor/tokens"] == direct["tokens"] == n_kept  # dropped tokens leave the token count
    assert got["actor/loss"] == pytest.approx(direct["loss"], abs=1e-6)
    assert got["actor/grad_norm"] == pytest.approx(direct["grad_norm"], rel=1e-5)
    assert got["rollout_corr/masked_frac"] == pytest.approx(1 - n_kept / n_all)
    logs = torch.cat([x.log().abs() for x in ratios])
    assert got["rollout_corr/logp_abs_diff_max"] == pytest.approx(math.log(1 / 0.3), rel=1e-4)
    assert got["rollout_corr/logp_abs_diff_mean"] == pytest.approx(float(logs.mean()), rel=1e-4)
    same = torch.cat(versions) == STEP
    assert got["rollout_corr/same_version_frac"] == pytest.approx(float(same.double().mean()))
    assert got["rollout_corr/logp_abs_diff_mean_same_version"] == pytest.approx(float(logs[same].mean()), rel=1e-4)
    assert "rollout_corr/is_capped_frac" not in got  # ppo_clip without rollout_is: no weight to cap


def test_update_without_per_token_versions_uses_rows_wholly_of_the_trainers_version() -> None:
    prompts, responses, fields = make_batch(4, seed=42, max_response=6)
    old = _engine().compute_log_probs(prompts, responses)[0]
    ratios = [_ratios(r.numel()) for r in responses]
    behav = [o - torch.log(x) for o, x in zip(old, ratios)]
    columns = {"prompt_ids": prompts, "response_ids": responses, "advantages": fields["advantages"],
               "behav_log_probs": behav, "scores": torch.zeros(4),
               "gen_version": torch.tensor([STEP, STEP - 1, STEP, STEP - 2])}
    io = {"inputs": ["prompt_ids", "response_ids", "advantages", "behav_log_probs", "scores", "gen_version"],
          "outputs": []}
    batch = {"rows": 4, "task": "update", "partition": "p", "timeout_s": 1.0}
    algo = AlgorithmConfig(policy_loss="decoupled_ppo")  # the async default: its own capped weight
    got = _actor(_engine(), _Queue(columns), algo).update(STEP, batch, io)
    n_same = responses[0].numel() + responses[2].numel()
    assert got["rollout_corr/same_version_frac"] == pytest.approx(n_same / sum(r.numel() for r in responses))
    assert {"rollout_corr/logp_abs_diff_mean", "rollout_corr/logp_abs_diff_max", "rollout_corr/prob_abs_diff_mean",
            "rollout_corr/logp_abs_diff_mean_same_version", "rollout_corr/is_capped_frac"} <= set(got)
    # decoupled_ppo caps its weight exp(old - behav) at is_cap 2: the tokens of ratio 3
    capped = torch.cat(ratios) > 2.0
    assert 0 < int(capped.sum()) and got["rollout_corr/is_capped_frac"] == pytest.approx(float(capped.double().mean()))
    with pytest.raises(ValueError, match="algorithm.rollout_is / rollout_mask .* need the behaviour log-probs"):
        no_behav = dict(io, inputs=[c for c in io["inputs"] if c != "behav_log_probs"])
        _actor(_engine(), _Queue(columns), dataclasses.replace(algo, policy_loss="ppo_clip", rollout_is="token")
               ).update(STEP, batch, no_behav)
