"""The micro-batch layout built with whole-batch writes equals the row-by-row construction it
replaced: random batches (empty responses, pad ids that also occur as tokens, loss masks), and
a row longer than the padded width refused by position."""
from __future__ import annotations

import pytest
import torch

from asyncflow.engines.train.microbatch import build_micro_batch, pad_right, slice_fields


def _rows_one_by_one(rows, length, value):
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_layout_equals_the_row_by_row_construction(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (), generator=g))
    pad_id = int(torch.randint(0, 3, (), generator=g))  # 1 and 2 are also tokens here
    prompts = [torch.randint(0, 6, (int(torch.randint(1, 9, (), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(0, 6, (int(torch.randint(0, 12, (), generator=g)),), generator=g) for _ in range(n)]
    masks = [torch.rand(r.numel(), generator=g) < 0.7 for r in responses]
    idx = sorted(torch.randperm(n, generator=g)[: max(1, n // 2)].tolist())
    mb = build_micro_batch(prompts, responses, idx, pad_id=pad_id, loss_masks=masks)

    seqs = [torch.cat([prompts[i], responses[i]]) for i in idx]
    width = max(s.numel() for s in seqs)
    rlens = [responses[i].numel() for i in idx]
    rwidth = max(max(rlens), 1)
    assert torch.equal(mb.input_ids, _rows_one_by_one(seqs, width, pad_id))
    real = torch.arange(rwidth)[None, :] < torch.tensor(rlens)[:, None]
    assert torch.equal(mb.mask, real & _rows_one_by_one([masks[i] for i in idx], rwidth, False))
    for row, i in enumerate(idx):
        p, r = prompts[i].numel(), responses[i].numel()
        assert mb.targets[row, :r].tolist() == responses[i].tolist()
        assert mb.logit_pos[row, :r].tolist() == list(range(p - 1, p - 1 + r))
        assert mb.attention_mask[row].tolist() == [1] * (p + r) + [0] * (width - p - r)

    fields = {"lp": [torch.randn(r.numel(), generator=g) for r in responses], "adv": torch.randn(n, generator=g)}
    sliced = slice_fields(fields, mb, torch.device("cpu"))
    want = _rows_one_by_one([fields["lp"][i] for i in idx], mb.mask.shape[1], 0.0).masked_fill(~mb.mask, 0)
    assert torch.equal(sliced["lp"], want)
    assert torch.equal(sliced["adv"], fields["adv"][idx])


def test_a_row_longer_than_the_width_is_refused_by_position():
    with pytest.raises(ValueError, match="row 1 has 4 elements, more than the padded length 3"):
        pad_right([torch.ones(2), torch.ones(4)], 3)
    with pytest.raises(ValueError, match="pad_right needs at least one row"):
        pad_right([], 3)
