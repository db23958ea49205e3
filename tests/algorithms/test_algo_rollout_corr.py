"""Rollout correction (asyncflow/algorithms/rollout_corr.py): hand-computed weights, masks and
mismatch measures on fixed inputs whose padding holds -inf and NaN."""
from __future__ import annotations

import math

import pytest
import torch
from _alg_helpers import assert_close

from asyncflow.algorithms import (
    algorithm_config_problems,
    mismatch_terms,
    rollout_correction,
    rollout_is_weights,
    rollout_keep_mask,
    rollout_log_ratio,
    sequence_log_ratio,
)
from asyncflow.config import AlgorithmConfig, ConfigError, load_config, policy_loss_name

NAN, INF = float("nan"), float("inf")


def _pair(ratios: list[list[float | None]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """old and behav log-probs [B, T] whose ratio exp(old - behav) is the given one per token
    (None: padding, where old holds NaN and behav -inf), and the mask."""
    old, behav, mask = [], [], []
    for row in ratios:
        old.append([NAN if r is None else math.log(0.25) for r in row])
        behav.append([-INF if r is None else math.log(0.25) - math.log(r) for r in row])
        mask.append([r is not None for r in row])
    return torch.tensor(old), torch.tensor(behav), torch.tensor(mask)


# ---- the log-ratios ------------------------------------------------------------------------------

def test_log_ratio_is_old_minus_behav_zero_at_padding_and_clamped() -> None:
    old = torch.tensor([[-1.0, -2.0, NAN, -1.0]])
    behav = torch.tensor([[-1.5, -1.0, -INF, -40.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    assert_close(rollout_log_ratio(old, behav, mask), torch.tensor([[0.5, -1.0, 0.0, 20.0]]))
    assert_close(rollout_log_ratio(old, behav, mask, max_log_ratio=5.0), torch.tensor([[0.5, -1.0, 0.0, 5.0]]))


def test_sequence_log_ratio_sums_or_averages_the_real_tokens() -> None:
    lr = torch.tensor([[0.5, -0.2, 99.0], [1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert_close(sequence_log_ratio(lr, mask), torch.tensor([0.3, 6.0, 0.0]))
    assert_close(sequence_log_ratio(lr, mask, geometric=True), torch.tensor([0.15, 2.0, 0.0]))
    assert_close(sequence_log_ratio(lr, mask, max_log_ratio=4.0), torch.tensor([0.3, 4.0, 0.0]))


# ---- importance weights ----------------------------------------------------------------------------

def test_token_is_weights_by_hand() -> None:
    # ratios 3, 1.5, 0.5 and padding; cap 2 -> 2 (capped), 1.5, 0.5, 0
    old, behav, mask = _pair([[3.0, 1.5, 0.5, None]])
    lr = rollout_log_ratio(old, behav, mask)
    w, capped = rollout_is_weights(lr, mask, "token", 2.0)
    assert_close(w, torch.tensor([[2.0, 1.5, 0.5, 0.0]]))
    assert capped.tolist() == [[True, False, False, False]]


def test_sequence_is_weights_by_hand_with_padding_and_caps() -> None:
    # row 0: 2 x 1.5 = 3 -> capped at 2 on both tokens; the padding (NaN / -inf) plays no part
    # row 1: 0.5 x 0.8 x 1.25 = 0.5 -> 0.5 on every token
    # row 2: no token -> 0
    old, behav, mask = _pair([[2.0, 1.5, None], [0.5, 0.8, 1.25], [None, None, None]])
    lr = rollout_log_ratio(old, behav, mask)
    w, capped = rollout_is_weights(lr, mask, "sequence", 2.0)
    assert_close(w, torch.tensor([[2.0, 2.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))
    assert capped.tolist() == [[True, True, False], [False, False, False], [False, False, False]]
    # a cap above the product leaves it: 3 on row 0
    w, capped = rollout_is_weights(lr, mask, "sequence", 5.0)
    assert_close(w[0], torch.tensor([3.0, 3.0, 0.0]))
    assert not capped.any()
    # geometric mean: sqrt(3) on row 0, 0.5 ** (1/3) on row 1
    w, capped = rollout_is_weights(lr, mask, "geometric", 2.0)
    g1 = 0.5 ** (1 / 3)
    assert_close(w, torch.tensor([[math.sqrt(3.0), math.sqrt(3.0), 0.0], [g1, g1, g1], [0.0, 0.0, 0.0]]))
    assert not capped.any()


def test_sequence_weight_of_a_long_sequence_saturates_at_the_cap_not_inf() -> None:
    old, behav, mask = _pair([[10.0] * 50])  # product 1e50: log 115 clamped to 20 before exp
    w, capped = rollout_is_weights(rollout_log_ratio(old, behav, mask), mask, "sequence", 2.0)
    assert torch.isfinite(w).all() and w.eq(2.0).all() and capped.all()


# ---- masks --------------------------------------------------------------------------------------------

# row 0: 3, 1.5      (product 4.5: out of [0.5, 2]; geometric 2.12: out)
# row 1: 0.6, 0.8, 1.25 (product 0.6, geometric 0.84: in; every token in)
# row 2: 3, 0.25, 1  (product 0.75, geometric 0.91: in; tokens 0 and 1 out)
# row 3: padding only
MASK_RATIOS = [[3.0, 1.5, None], [0.6, 0.8, 1.25], [3.0, 0.25, 1.0], [None, None, None]]
T, F = True, False


@pytest.mark.parametrize("level, expected", [
    ("token", [[F, T, F], [T, T, T], [F, F, T], [F, F, F]]),
    ("sequence", [[F, F, F], [T, T, T], [T, T, T], [F, F, F]]),
    ("geometric", [[F, F, F], [T, T, T], [T, T, T], [F, F, F]]),
    ("any_token", [[F, F, F], [T, T, T], [F, F, F], [F, F, F]]),
])
def test_keep_masks_by_hand(level: str, expected: list[list[bool]]) -> None:
    old, behav, mask = _pair(MASK_RATIOS)
    keep = rollout_keep_mask(rollout_log_ratio(old, behav, mask), mask, level, 0.5, 2.0)
    assert keep.tolist() == expected


@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "any_token"])
def test_keep_mask_ignores_what_the_padding_of_the_log_ratio_holds(level: str) -> None:
    lr = torch.tensor([[0.1, -0.1, 99.0, NAN]])  # two real tokens well inside [0.5, 2], then garbage
    mask = torch.tensor([[1, 1, 0, 0]])
    assert rollout_keep_mask(lr, mask, level, 0.5, 2.0).tolist() == [[T, T, F, F]]


def test_band_edges_are_kept_and_a_tight_band_drops() -> None:
    lr = torch.tensor([[math.log(0.5), math.log(2.0), math.log(1.0005), math.log(0.9)]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert rollout_keep_mask(lr, mask, "token", 0.5, 2.0).tolist() == [[T, T, T, T]]
    assert rollout_keep_mask(lr, mask, "token", 0.999, 1.001).tolist() == [[F, F, T, F]]


def test_nan_ratio_on_a_real_token_is_dropped() -> None:
    lr = torch.tensor([[NAN, 0.1]])
    assert rollout_keep_mask(lr, torch.ones(1, 2), "token", 0.5, 2.0).tolist() == [[F, T]]


# ---- the combination, as the actor calls it ------------------------------------------------------

def test_rollout_correction_follows_the_config() -> None:
    old, behav, mask = _pair(MASK_RATIOS)
    off = rollout_correction(old, behav, mask, AlgorithmConfig())
    assert off.weights is None and off.capped is None and off.keep is None
    both = rollout_correction(old, behav, mask, AlgorithmConfig(rollout_is="token", rollout_is_cap=2.0,
                                                                rollout_mask="any_token"))
    assert_close(both.weights, torch.tensor([[2.0, 1.5, 0.0], [0.6, 0.8, 1.25], [2.0, 0.25, 1.0], [0.0] * 3]))
    assert both.capped.tolist() == [[T, F, F], [F, F, F], [T, F, F], [F, F, F]]
    assert both.keep.tolist() == [[F, F, F], [T, T, T], [F, F, F], [F, F, F]]


@pytest.mark.parametrize("kwargs, key", [
    ({"rollout_is": "seq"}, "rollout_is"), ({"rollout_mask": "tokens"}, "rollout_mask"),
    ({"rollout_is": "token", "rollout_is_cap": 0.0}, "rollout_is_cap"),
    ({"rollout_mask": "token", "rollout_mask_low": 0.0}, "rollout_mask_low"),
    ({"rollout_mask": "token", "rollout_mask_low": 1.0}, "rollout_mask_low"),
    ({"rollout_mask": "token", "rollout_mask_high": 1.0}, "rollout_mask_high"),
    ({"rollout_mask": "token", "rollout_mask_high": NAN}, "rollout_mask_high"),
    ({"rollout_is": "token", "policy_loss": "tis"}, "rollout_is"),
    ({"rollout_is": "sequence", "policy_loss": "decoupled_ppo"}, "rollout_is"),
])
def test_bad_settings_are_value_errors_naming_the_key(kwargs: dict, key: str) -> None:
    old, behav, mask = _pair([[1.0, 2.0]])
    with pytest.raises(ValueError, match=rf"algorithm\.{key}: "):
        rollout_correction(old, behav, mask, AlgorithmConfig(**kwargs))
    assert any(p.startswith(f"algorithm.{key}: ") for p in algorithm_config_problems(AlgorithmConfig(**kwargs)))


def test_config_loads_checks_and_resolves_auto() -> None:
    cfg = load_config(None, ["algorithm.rollout_is=sequence", "algorithm.rollout_is_cap=5",
                             "algorithm.rollout_mask=geometric", "algorithm.rollout_mask_low=0.999",
                             "algorithm.rollout_mask_high=1.001"])
    a = cfg.algorithm
    assert (a.rollout_is, a.rollout_is_cap, a.rollout_mask, a.rollout_mask_low, a.rollout_mask_high) == \
        ("sequence", 5.0, "geometric", 0.999, 1.001)
    # auto: ppo_clip with rollout_is (its weight replaces decoupled_ppo's own), in every mode
    assert policy_loss_name(cfg) == "ppo_clip"
    assert policy_loss_name(load_config(None, ["workflow.mode=async"])) == "decoupled_ppo"
    assert policy_loss_name(load_config(None, ["workflow.mode=async", "algorithm.rollout_mask=token"])) == \
        "decoupled_ppo"
    with pytest.raises(ConfigError, match="algorithm.rollout_mask_low: must be in"):
        load_config(None, ["algorithm.rollout_mask_low=2"])
    with pytest.raises(ConfigError, match="algorithm.rollout_is: 'token' with algorithm.policy_loss=tis"):
        load_config(None, ["algorithm.rollout_is=token", "algorithm.policy_loss=tis"])


# ---- the mismatch measures ---------------------------------------------------------------------------

def test_mismatch_terms_by_hand_padding_ignored() -> None:
    # token 0: old p 0.5, behav p 0.4 -> |dlogp| = log 1.25, |dp| = 0.1, kl = log 0.8
    # token 1: old p 0.3, behav p 0.1 -> |dlogp| = log 3,    |dp| = 0.2, kl = log(1/3)
    # token 2: padding: old NaN, behav -inf
    old = torch.tensor([[math.log(0.5), math.log(0.3), NAN]])
    behav = torch.tensor([[math.log(0.4), math.log(0.1), -INF]])
    mask = torch.tensor([[True, True, False]])
    t = mismatch_terms(old, behav, mask)
    assert_close(t["logp_abs_diff"], torch.tensor([[math.log(1.25), math.log(3.0), 0.0]]))
    assert_close(t["prob_abs_diff"], torch.tensor([[0.1, 0.2, 0.0]]))
    assert_close(t["kl"], torch.tensor([[math.log(0.8), -math.log(3.0), 0.0]]))
    # k3 with rho = p_old / p_behav: (1.25 - 1) - log 1.25, (3 - 1) - log 3
    assert_close(t["k3_kl"], torch.tensor([[0.25 - math.log(1.25), 2.0 - math.log(3.0), 0.0]]))
    assert all(torch.isfinite(v).all() for v in t.values())
