"""The rollout correction through the actor's loss (asyncflow/workers/actor_loss.py): the
rollout_corr/ metrics over several micro-batches, the weights and the mask in the gradient."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.config import AlgorithmConfig
from asyncflow.engines.train.base import LossNorm
from asyncflow.workers.actor_loss import RolloutCorr, policy_loss_fn

NAN, INF = float("nan"), float("inf")
PPO = AlgorithmConfig(policy_loss="ppo_clip")


def _micro_batch(lp: list[list[float]], diff: list[list[float]], versions: list[list[float]]):
    """One micro-batch as the engine hands it to loss_fn: log_probs [b, T] (0 at padding), a bool
    mask, and fields; behav = log_probs + diff on real tokens, -inf / NaN in the padding."""
    width = max(len(r) for r in lp)
    mask = torch.tensor([[j < len(r) for j in range(width)] for r in lp])
    pad = lambda rows, v: torch.tensor([r + [v] * (width - len(r)) for r in rows])  # noqa: E731
    log_probs = pad(lp, 0.0).requires_grad_(True)
    behav = pad([[a + d for a, d in zip(r, dr)] for r, dr in zip(lp, diff)], -INF)
    behav[:, -1:] = torch.where(mask[:, -1:], behav[:, -1:], NAN)  # NaN as well as -inf in the padding
    fields = {"advantages": pad([[1.0] * len(r) for r in lp], 0.0), "behav_log_probs": behav,
              "token_versions": pad(versions, 99.0)}
    return log_probs, mask, fields


def test_mismatch_metrics_are_exact_over_micro_batches_and_restricted_to_the_same_version() -> None:
    # |behav - old| per real token (old = the update's own forward here: one optimizer step):
    #   micro-batch A: [0.1, 0.5] (versions 3, 3)
    #   micro-batch B: [0.2] (version 2), [1.0, 0.3] (versions 2, 3)
    # all tokens: mean 2.1 / 5 = 0.42 (the mean of the micro-batch means would be 0.4), max 1.0
    # version 3 (the trainer's): tokens 0.1, 0.5, 0.3: mean 0.3, max 0.5, fraction 3/5
    corr = RolloutCorr(PPO, version=3)
    loss_fn = policy_loss_fn(PPO, corr)
    lps = {"A": [[-1.0, -2.0]], "B": [[-0.5], [-3.0, -0.2]]}
    diffs = {"A": [[0.1, -0.5]], "B": [[-0.2], [1.0, -0.3]]}
    vers = {"A": [[3.0, 3.0]], "B": [[2.0], [2.0, 3.0]]}
    norm = LossNorm(num_tokens=5.0, num_seqs=3.0)
    for k in ("A", "B"):
        log_probs, mask, fields = _micro_batch(lps[k], diffs[k], vers[k])
        loss, _ = loss_fn(log_probs, None, mask, fields, norm)
        assert torch.isfinite(loss)
    got = corr.metrics(*corr.totals())
    assert got["rollout_corr/logp_abs_diff_mean"] == pytest.approx(0.42)
    assert got["rollout_corr/logp_abs_diff_max"] == pytest.approx(1.0)
    assert got["rollout_corr/logp_abs_diff_mean_same_version"] == pytest.approx(0.3)
    assert got["rollout_corr/logp_abs_diff_max_same_version"] == pytest.approx(0.5)
    assert got["rollout_corr/same_version_frac"] == pytest.approx(0.6)
    pairs = [(-1.0, 0.1), (-2.0, -0.5), (-0.5, -0.2), (-3.0, 1.0), (-0.2, -0.3)]  # (old, behav - old)
    pdiff = [abs(math.exp(o + d) - math.exp(o)) for o, d in pairs]
    assert got["rollout_corr/prob_abs_diff_mean"] == pytest.approx(sum(pdiff) / 5)
    assert got["rollout_corr/prob_abs_diff_max"] == pytest.approx(max(pdiff))
    assert got["rollout_corr/prob_abs_diff_max_same_version"] == pytest.approx(max(pdiff[i] for i in (0, 1, 4)))
    assert got["rollout_corr/kl"] == pytest.approx(sum(d for _, d in pairs) / 5)
    assert got["rollout_corr/k3_kl"] == pytest.approx(sum(math.expm1(-d) + d for _, d in pairs) / 5)
    # no weight and no mask in force: their figures are absent, not 0
    assert not {"rollout_corr/is_capped_frac", "rollout_corr/is_weight_mean", "rollout_corr/masked_frac"} & set(got)


def test_no_token_of_the_trainers_version_leaves_the_same_version_figures_out() -> None:
    corr = RolloutCorr(PPO, version=7)
    log_probs, mask, fields = _micro_batch([[-1.0, -2.0]], [[0.1, 0.2]], [[6.0, 6.0]])
    policy_loss_fn(PPO, corr)(log_probs, None, mask, fields, LossNorm(2.0, 1.0))
    got = corr.metrics(*corr.totals())
    assert got["rollout_corr/same_version_frac"] == 0.0 and got["rollout_corr/logp_abs_diff_max"] == pytest.approx(0.2)
    assert "rollout_corr/logp_abs_diff_mean_same_version" not in got
    assert "rollout_corr/logp_abs_diff_max_same_version" not in got


def _rows(ratios: list[list[float]], adv: list[list[float]]):
    """Per-row fields as the actor has them: old_log_probs, behav_log_probs = old - log ratio."""
    old = [torch.linspace(-0.5, -2.0, len(r)) for r in ratios]
    behav = [o - torch.log(torch.tensor(r)) for o, r in zip(old, ratios)]
    return {"advantages": [torch.tensor(a) for a in adv], "old_log_probs": old, "behav_log_probs": behav}


def _as_engine_would(fields: dict[str, list[torch.Tensor]]):
    """Padded [b, T] fields, the mask (real token AND loss_mask), every field 0 outside it."""
    width = max(x.numel() for x in fields["old_log_probs"])
    real = torch.tensor([[j < x.numel() for j in range(width)] for x in fields["old_log_probs"]])
    mask = real.clone()
    if "loss_mask" in fields:
        mask &= torch.nn.utils.rnn.pad_sequence([m != 0 for m in fields["loss_mask"]], batch_first=True)
    padded = {k: torch.nn.utils.rnn.pad_sequence([x.float() for x in v], batch_first=True).masked_fill(~mask, 0.0)
              for k, v in fields.items() if k != "loss_mask"}
    return mask, padded


def test_weights_and_mask_through_the_loss_zero_gradient_on_dropped_tokens() -> None:
    # ratios exp(old - behav): row 0 [3, 1.5, 0.8], row 1 [0.4, 1.0]; band [0.5, 4]: 0.4 is dropped
    # token weights min(rho, 2): [2, 1.5, 0.8], [-, 1.0]; 4 tokens kept (the token-mean's divisor)
    # log_probs = old (ratio 1, unclipped): d loss / d log p = -A w / 4 on kept tokens, 0 on the dropped
    algo = dataclasses.replace(PPO, rollout_is="token", rollout_is_cap=2.0, rollout_mask="token",
                               rollout_mask_low=0.5, rollout_mask_high=4.0)
    rows = _rows([[3.0, 1.5, 0.8], [0.4, 1.0]], [[1.0, 2.0, -1.0], [1.0, 3.0]])
    corr = RolloutCorr(algo, version=0)
    train = corr.prepare(rows)
    assert "loss_mask" not in rows and [m.tolist() for m in train["loss_mask"]] == [[1, 1, 1], [0, 1]]
    mask, fields = _as_engine_would(train)
    assert int(mask.sum()) == 4
    log_probs = fields["old_log_probs"].clone().requires_grad_(True)
    loss, metrics = policy_loss_fn(algo, corr)(log_probs, None, mask, fields, LossNorm(num_tokens=4.0, num_seqs=2.0))
    loss.backward()
    assert_close(log_probs.grad, torch.tensor([[-0.5, -0.75, 0.2], [0.0, -0.75, 0.0]]))  # row 1: dropped, kept, padding
    assert log_probs.grad[1, 0] == 0.0
    assert metrics["actor/pg_loss"] == pytest.approx(-(2.0 + 3.0 - 0.8 + 3.0) / 4)
    got = corr.metrics(*corr.totals())
    assert got["rollout_corr/masked_frac"] == pytest.approx(1 / 5)
    assert got["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 2)
    assert got["rollout_corr/is_weight_mean"] == pytest.approx((2.0 + 1.5 + 0.8 + 1.0) / 4)
    assert got["rollout_corr/is_capped_frac"] == pytest.approx(1 / 4)
    # the mismatch is measured on every token, the dropped one included: max |log rho| = log 3
    assert got["rollout_corr/logp_abs_diff_max"] == pytest.approx(math.log(3.0), rel=1e-5)
    assert got["rollout_corr/logp_abs_diff_mean"] == pytest.approx(
        sum(abs(math.log(r)) for r in (3.0, 1.5, 0.8, 0.4, 1.0)) / 5, rel=1e-5)


def test_a_multi_turn_loss_mask_is_kept_and_tool_tokens_are_not_measured() -> None:
    algo = dataclasses.replace(PPO, rollout_mask="token")
    rows = _rows([[1.0, 9.0, 1.2]], [[1.0, 1.0, 1.0]])
    rows["loss_mask"] = [torch.tensor([1, 0, 1], dtype=torch.int8)]  # the 9.0 is a tool token's garbage
    corr = RolloutCorr(algo, version=0)
    train = corr.prepare(rows)
    assert train["loss_mask"][0].tolist() == [1, 0, 1]
    got = corr.metrics(*corr.totals())
    assert got["rollout_corr/masked_frac"] == 0.0
    assert got["rollout_corr/logp_abs_diff_max"] == pytest.approx(math.log(1.2), rel=1e-5)


def test_sequence_weight_inside_the_loss_at_the_updates_own_forward() -> None:
    # no old_log_probs field: old = this forward's log-probs; sequence ratios 0.5 x 1.2 = 0.6 and 4 -> cap 3
    algo = dataclasses.replace(PPO, rollout_is="sequence", rollout_is_cap=3.0)
    corr = RolloutCorr(algo, version=1)
    log_probs, mask, fields = _micro_batch([[-1.0, -2.0], [-0.5]], [[math.log(2.0), -math.log(1.2)], [-math.log(4.0)]],
                                           [[1.0, 1.0], [0.0]])
    loss, metrics = policy_loss_fn(algo, corr)(log_probs, None, mask, fields, LossNorm(3.0, 2.0))
    loss.backward()
    assert_close(log_probs.grad, torch.tensor([[-0.2, -0.2], [-1.0, 0.0]]), rtol=1e-5, atol=1e-6)
    got = corr.metrics(*corr.totals())
    assert got["rollout_corr/is_capped_frac"] == pytest.approx(1 / 3)
    assert got["rollout_corr/is_weight_mean"] == pytest.approx((0.6 + 0.6 + 3.0) / 3, rel=1e-5)


def test_tis_capped_fraction_is_reported_and_a_mask_needs_preparing() -> None:
    algo = AlgorithmConfig(policy_loss="tis", tis_cap=1.5)
    corr = RolloutCorr(algo, version=0)
    # ratios exp(old - behav) = 2 and 1.1 -> one of two tokens capped at 1.5
    log_probs, mask, fields = _micro_batch([[-1.0, -2.0]], [[-math.log(2.0), -math.log(1.1)]], [[0.0, 0.0]])
    policy_loss_fn(algo, corr)(log_probs, None, mask, fields, LossNorm(2.0, 1.0))
    assert corr.metrics(*corr.totals())["rollout_corr/is_capped_frac"] == pytest.approx(0.5)
    masked = dataclasses.replace(PPO, rollout_mask="token")
    with pytest.raises(ValueError, match=r"algorithm\.rollout_mask='token': the mask changes the loss's token counts"):
        policy_loss_fn(masked)(log_probs, None, mask, fields, LossNorm(2.0, 1.0))
    no_behav = {k: v for k, v in fields.items() if k != "behav_log_probs"}
    with pytest.raises(ValueError, match=r"algorithm\.rollout_is / rollout_mask .* need the behav_log_probs"):
        policy_loss_fn(masked)(log_probs, None, mask, no_behav, LossNorm(2.0, 1.0))


def test_totals_add_up_over_ranks() -> None:
    """Two ranks' totals summed (and maxed) give the figures of one rank holding both batches."""
    def run(batches):
        corr = RolloutCorr(PPO, version=0)
        for lp, d in batches:
            log_probs, mask, fields = _micro_batch(lp, d, [[0.0] * len(r) for r in lp])
            policy_loss_fn(PPO, corr)(log_probs, None, mask, fields, LossNorm(1.0, 1.0))
        return corr.totals()
    a, b = ([[-1.0, -2.0, -0.1]], [[0.3, 0.1, 0.2]]), ([[-0.5]], [[-0.9]])
    (sa, ma), (sb, mb) = run([a]), run([b])
    together = RolloutCorr.metrics(sa + sb, torch.maximum(ma, mb))
    assert together == pytest.approx(RolloutCorr.metrics(*run([a, b])))
    assert together["rollout_corr/logp_abs_diff_mean"] == pytest.approx(1.5 / 4)
    empty = RolloutCorr(PPO, version=0)
    assert RolloutCorr.metrics(*empty.totals()) == {}  # a rank without rows adds nothing


@pytest.mark.parametrize("prepared", [False, True])
def test_ppo_clip_with_token_rollout_is_is_decoupled_ppo(prepared: bool) -> None:
    """rollout_is=token with cap c on ppo_clip gives decoupled_ppo's loss and gradient (is_cap c),
    whether the weight is taken inside the loss or by prepare() before it."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 2, 5]
    old = [-torch.rand(n, generator=g) * 3 for n in lengths]
    rows = {"advantages": [torch.randn(n, generator=g) for n in lengths], "old_log_probs": old,
            "behav_log_probs": [o + 0.8 * torch.randn(o.shape, generator=g) for o in old]}
    mask, padded = _as_engine_would(rows)
    current = padded["old_log_probs"] + 0.3 * torch.randn(mask.shape, generator=g) * mask

    def run(algo, fields):
        lp = current.clone().requires_grad_(True)
        loss, _ = policy_loss_fn(algo, corr)(lp, None, mask, fields, LossNorm(float(mask.sum()), 3.0))
        loss.backward()
        return loss.detach(), lp.grad

    corr = RolloutCorr(AlgorithmConfig(policy_loss="decoupled_ppo", is_cap=1.7))
    want = run(corr.algo, padded)
    corr = RolloutCorr(dataclasses.replace(PPO, rollout_is="token", rollout_is_cap=1.7))
    fields = _as_engine_would(corr.prepare(rows))[1] if prepared else padded
    got = run(corr.algo, fields)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert corr.metrics(*corr.totals())["rollout_corr/is_capped_frac"] > 0
