"""The built-in recipes' driver-side stages are pure functions of a DriverBatch: advantages
computed once per row (group estimators over whole groups, GAE from values, the KL folded
into the reward), the dynamic-sampling filter and DAPO's overlong shaping."""
from __future__ import annotations

import pytest
import torch

from asyncflow.config import AlgorithmConfig
from asyncflow.workflow.driver_stages import advantages, equal_score_filter, overlong_shaping
from asyncflow.workflow.stages import DriverBatch


def _batch(scores, lengths, groups, **extra):
    cols = {"scores": torch.tensor(scores, dtype=torch.float32),
            "response_ids": [torch.arange(n) for n in lengths], **extra}
    return DriverBatch(0, cols, list(groups))


def test_grpo_advantages_are_group_normalised_and_constant_over_tokens():
    out = advantages(AlgorithmConfig())(_batch([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], [3, 1, 2, 4, 2, 1], [7, 7, 7, 9, 9, 9]))
    adv = out["advantages"]
    assert [len(a) for a in adv] == [3, 1, 2, 4, 2, 1]
    assert all(torch.all(a == a[0]) for a in adv)
    # group 7: mean 1/3, Bessel std sqrt(1/3)
    expect = (1.0 - 1 / 3) / ((1 / 3) ** 0.5 + 1e-6)
    assert float(adv[0][0]) == pytest.approx(expect, rel=1e-5)
    assert all(float(a.abs().max()) == 0.0 for a in adv[3:])  # an all-equal group: exactly zero


def test_gae_uses_the_values_column_and_returns_regression_targets():
    algo = AlgorithmConfig(advantage="gae", lam=0.95, whiten=False)
    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5])]
    out = advantages(algo)(_batch([1.0, 0.0], [3, 1], [0, 1], values=values))
    assert [len(a) for a in out["advantages"]] == [3, 1]
    for adv, ret, v in zip(out["advantages"], out["returns"], values):
        assert torch.allclose(ret, adv + v)
    assert float(out["advantages"][1][0]) == pytest.approx(-0.5)


def test_kl_in_reward_needs_the_reference_log_probs():
    algo = AlgorithmConfig(kl_coef=0.5, kl_in_reward=True)
    with pytest.raises(ValueError, match="ref_log_probs"):
        advantages(algo)(_batch([1.0, 0.0], [2, 2], [0, 0]))
    lp = [torch.zeros(2)] * 3
    ref = [torch.zeros(2), torch.full((2,), -1.0), torch.zeros(2)]  # row 1 drifted from the reference
    with_kl = advantages(algo)(_batch([1.0, 0.0, 0.0], [2] * 3, [0] * 3, behav_log_probs=lp, ref_log_probs=ref))
    plain = advantages(AlgorithmConfig())(_batch([1.0, 0.0, 0.0], [2] * 3, [0] * 3))
    assert float(plain["advantages"][1][0]) == float(plain["advantages"][2][0])
    assert float(with_kl["advantages"][1][0]) < float(with_kl["advantages"][2][0])  # the KL costs row 1


def test_equal_score_filter_keeps_whole_groups_with_spread():
    keep = equal_score_filter()(_batch([1, 1, 0, 0, 1, 1], [1] * 6, [0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, False, False, False, False]
    keep = equal_score_filter()(_batch([1, 0, 0, 0, 0.1, 0.1001], [1] * 6, [0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [True, True, False, False, True, True]


def test_overlong_shaping_is_linear_in_the_buffer_and_capped():
    shaped = overlong_shaping(max_new_tokens=8, buffer=4, penalty=1.0)(_batch([1.0] * 5, [2, 4, 5, 6, 8], range(5)))
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.0])
    with pytest.raises(ValueError, match="reward.overlong_buffer"):
        overlong_shaping(max_new_tokens=8, buffer=9, penalty=1.0)


def test_remax_advantage_is_score_minus_the_greedy_baseline():
    from recipes.remax.recipe import remax_advantages
    b = _batch([1.0, 0.0, 1.0], [2, 3, 1], [0, 0, 1], baseline_scores=torch.tensor([0.5, 0.5, 1.0]))
    adv = remax_advantages(b)["advantages"]
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [-0.5, -0.5, -0.5], [0.0]]


# ------------------------------------------------------------------ multi-turn rows: a loss_mask column
def _compact(rows, masks):
    """Each row with its tool tokens cut out."""
    return [r[m.bool()] for r, m in zip(rows, masks)]


_TOOL_MASKS = [torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.int8),  # ends in tool output
               torch.tensor([1, 0, 1], dtype=torch.int8),
               torch.tensor([1, 1, 1, 1], dtype=torch.int8),  # no tool call
               torch.tensor([0, 1, 1, 0, 0, 1, 1], dtype=torch.int8),
               torch.tensor([True, False]),  # bool works too
               torch.tensor([1, 1, 0, 1, 1], dtype=torch.int8)]


@pytest.mark.parametrize("algo", [
    AlgorithmConfig(),
    AlgorithmConfig(advantage="dr_grpo"),
    AlgorithmConfig(advantage="rloo"),
    AlgorithmConfig(advantage="reinforce_pp", gamma=0.9),
    AlgorithmConfig(advantage="reinforce_pp", gamma=0.8, whiten=False),
    AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8),
    AlgorithmConfig(advantage="gae", gamma=0.95, lam=0.9, whiten=False),
    AlgorithmConfig(kl_coef=0.3, kl_in_reward=True, advantage="reinforce_pp", gamma=0.9),
], ids=lambda a: f"{a.advantage}-g{a.gamma}-w{int(a.whiten)}-kl{int(a.kl_in_reward)}")
def test_loss_mask_advantages_are_those_of_the_rows_without_their_tool_tokens(algo):
    """A tool token is as if cut out of its row: the advantages and returns on the model tokens
    are those of the compacted rows (reward on the last model token, no discount step, no KL,
    whitening over model tokens), and 0 on the tool tokens; rows keep their full length."""
    masks = _TOOL_MASKS
    lengths = [len(m) for m in masks]
    scores, groups = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25], [0, 0, 0, 1, 1, 1]
    g = torch.Generator().manual_seed(0)
    extra = {"values": [torch.randn(n, generator=g) for n in lengths],
             "behav_log_probs": [-torch.rand(n, generator=g) for n in lengths],
             "ref_log_probs": [-torch.rand(n, generator=g) for n in lengths]}
    got = advantages(algo)(_batch(scores, lengths, groups, loss_mask=masks, **extra))
    compact = {k: _compact(v, masks) for k, v in extra.items()}
    want = advantages(algo)(_batch(scores, [int(m.sum()) for m in masks], groups, **compact))
    for key in ("advantages", "returns"):
        assert [len(a) for a in got[key]] == lengths
        for row, ref, m in zip(got[key], want[key], masks):
            assert torch.all(row[~m.bool()] == 0.0), key
            assert torch.allclose(row[m.bool()], ref, atol=1e-6), (key, row, ref)
    assert any(float(a.abs().max()) > 0 for a in got["advantages"])


def test_loss_mask_puts_the_reward_on_the_last_model_token():
    # gamma 0.5, no whitening: row [m, m, tool, tool, m, tool] with score 1 -> returns
    # [0.25, 0.5, 0, 0, 1, 0]: the reward sits on position 4, and the tool tokens cost no discount
    algo = AlgorithmConfig(advantage="reinforce_pp", gamma=0.5, whiten=False)
    out = advantages(algo)(_batch([1.0], [6], [0], loss_mask=[torch.tensor([1, 1, 0, 0, 1, 0])]))
    assert out["returns"][0].tolist() == [0.25, 0.5, 0.0, 0.0, 1.0, 0.0]
    assert out["advantages"][0].tolist() == [0.25, 0.5, 0.0, 0.0, 1.0, 0.0]
    # GRPO: the group's advantages on model tokens only, the same as without tool tokens
    masks = [torch.tensor([1, 0, 1]), torch.tensor([0, 1])]
    out = advantages(AlgorithmConfig())(_batch([1.0, 0.0], [3, 2], [0, 0], loss_mask=masks))
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # deviations +-0.5, Bessel std sqrt(0.5)
    assert out["advantages"][0].tolist() == pytest.approx([a, 0.0, a])
    assert out["advantages"][1].tolist() == pytest.approx([0.0, -a])


def test_loss_mask_ignores_values_at_tool_tokens():
    algo = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.9, whiten=False)
    masks = [torch.tensor([1, 0, 0, 1])]
    values = [torch.tensor([0.2, 0.3, 0.4, 0.5])]
    base = advantages(algo)(_batch([1.0], [4], [0], loss_mask=masks, values=values))
    values[0] = torch.tensor([0.2, 1e6, float("nan"), 0.5])
    other = advantages(algo)(_batch([1.0], [4], [0], loss_mask=masks, values=values))
    for key in ("advantages", "returns"):
        assert torch.equal(base[key][0], other[key][0]), key


@pytest.mark.parametrize("bad, match", [
    ([torch.ones(3), torch.ones(1)], "row 1: 1 entries for a response of 2 tokens"),
    ([torch.ones(3), torch.tensor([1, 2])], "row 1: must hold only 0 and 1"),
    ([torch.ones(3)], "1 rows for 2 responses"),
])
def test_bad_loss_mask_column_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        advantages(AlgorithmConfig())(_batch([1.0, 0.0], [3, 2], [0, 0], loss_mask=bad))


def test_jagged_rows_read_as_unpad_rows_and_store_as_one_column():
    from asyncflow.transfer_queue.columns import to_column
    from asyncflow.workflow.driver_stages import jagged_rows, unpad_rows
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    mask = torch.arange(4)[None, :] < torch.tensor([2, 0, 4])[:, None]
    rows = jagged_rows(x, mask)
    want = unpad_rows(x, mask)
    assert len(rows) == 3 and [r.tolist() for r in rows] == [w.tolist() for w in want]
    assert rows[-1].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert [r.tolist() for r in rows[1:]] == [[], [8.0, 9.0, 10.0, 11.0]]
    assert rows.values.dtype == torch.float32
    with pytest.raises(IndexError):
        rows[3]
    assert to_column("advantages", rows) is rows  # the TransferQueue takes it as it is
