"""The per-token "loss_mask" field of train_step (multi-turn rows: model tokens interleaved with
tool / environment tokens): a masked token never receives gradient and counts in no
normalisation and no metric. The 2-rank version is in test_train_fsdp_dist.py."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.microbatch import build_micro_batch, pad_right
from asyncflow.transfer_queue.columns import to_column
from tests.engines._train_helpers import loss_masks_for, make_batch, ppo_loss, tiny_model, value_loss
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse


def _engine(budget: int = 24, **kw) -> FSDPEngine:
    # No clipping: the gradients left on the parameters are the step's raw gradients.
    return FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, micro_batch_tokens=budget, grad_clip=0.0),
                      **kw)


def _batch(n: int = 6, seed: int = 21):
    prompts, responses, fields = make_batch(n, seed=seed, max_response=10)
    masks = loss_masks_for(responses, seed=seed)
    return prompts, responses, fields, masks


def _grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _reference(prompts, responses, fields, masks):
    """ppo_loss written out per token on one full forward per row, the masked tokens' per-token
    loss multiplied by 0 and every count taken over model tokens only."""
    model = tiny_model(seed=0)
    lp, ent = [], []
    for p, r in zip(prompts, responses):
        logits = model(torch.cat([p, r])[None]).logits[0].float()
        full = torch.log_softmax(logits, -1)[p.numel() - 1:-1]
        lp.append(full.gather(-1, r[:, None]).squeeze(-1))
        ent.append(-(full.exp() * full).sum(-1))
    width = max(r.numel() for r in responses)
    lp, ent = pad_right(lp, width), pad_right(ent, width)
    keep = pad_right([m.bool() for m in masks], width, False).float()  # 0 on tool tokens and padding
    old, adv = pad_right(fields["old_log_probs"], width), pad_right(fields["advantages"], width)
    n_tokens = keep.sum()
    n_seqs = (keep.sum(-1) > 0).sum()
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = (pg * keep).sum() / n_tokens
    loss = loss + 0.1 * (fields["seq_weight"] * (lp * keep).sum(-1)).sum() / n_seqs
    loss = loss - 0.01 * (ent * keep).sum() / n_tokens
    loss.backward()
    return float(loss.detach()), _grads(model), float(n_tokens), float(n_seqs)


def test_masked_step_equals_zeroed_per_token_loss_with_model_token_counts():
    prompts, responses, fields, masks = _batch()
    assert any(0 < int(m.sum()) < m.numel() for m in masks) and any(int(m.sum()) == 0 for m in masks)
    ref_loss, ref_grads, n_tokens, n_seqs = _reference(prompts, responses, fields, masks)
    seen = []

    def loss_fn(log_probs, entropy, mask, f, norm):
        seen.append(norm)
        return ppo_loss(log_probs, entropy, mask, f, norm)

    engine = _engine(budget=24)
    metrics = engine.train_step(prompts, responses, {**fields, "loss_mask": masks}, loss_fn, with_entropy=True)
    assert metrics["n_micro_batches"] > 1
    assert metrics["tokens"] == n_tokens == sum(int(m.sum()) for m in masks) < sum(r.numel() for r in responses)
    assert seen[0].num_tokens == n_tokens and seen[0].num_seqs == n_seqs == len(responses) - 1
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
    grads = _grads(engine.model)
    assert set(grads) == set(ref_grads)
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    assert worst <= 1e-5, f"gradients differ by {worst}"


def test_values_at_masked_tokens_change_nothing():
    """Other advantages and old log-probs (even NaN / inf) on the tool tokens: the same step,
    bit for bit; and a loss that forgets the mask still sends no gradient through them."""
    prompts, responses, fields, masks = _batch()
    engine = _engine(budget=24)
    base = engine.train_step(prompts, responses, {**fields, "loss_mask": masks}, ppo_loss, with_entropy=True)
    base_grads = _grads(engine.model)

    garbage = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}
    for i, m in enumerate(masks):
        drop = ~m.bool()
        garbage["advantages"][i] = fields["advantages"][i].masked_fill(drop, 1e6)
        garbage["old_log_probs"][i] = fields["old_log_probs"][i].masked_fill(drop, float("nan"))
    garbage["old_log_probs"][0] = garbage["old_log_probs"][0].masked_fill(~masks[0].bool(), float("-inf"))
    engine = _engine(budget=24)
    got = engine.train_step(prompts, responses, {**garbage, "loss_mask": [m.float() for m in masks]}, ppo_loss,
                            with_entropy=True)
    for key in ("loss", "grad_norm", "tokens"):
        assert got[key] == base[key], key
    grads = _grads(engine.model)
    assert all(torch.equal(grads[k], base_grads[k]) for k in base_grads)

    def forgetful(log_probs, entropy, mask, f, norm):  # ignores the mask altogether
        return -(log_probs.sum() + 0.01 * entropy.sum()) / norm.num_tokens, {}

    def careful(log_probs, entropy, mask, f, norm):
        return -((log_probs * mask).sum() + 0.01 * (entropy * mask).sum()) / norm.num_tokens, {}

    results = []
    for fn in (forgetful, careful):
        engine = _engine(budget=24)
        results.append((engine.train_step(prompts, responses, {"loss_mask": masks}, fn, with_entropy=True)["loss"],
                        _grads(engine.model)))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[1][1])


def test_all_ones_loss_mask_is_the_plain_step():
    prompts, responses, fields, _ = _batch(5, seed=22)
    ones = [torch.ones(r.shape, dtype=torch.int8) for r in responses]
    out = []
    for f in (fields, {**fields, "loss_mask": ones}):
        engine = _engine(budget=16)
        out.append((engine.train_step(prompts, responses, f, ppo_loss, with_entropy=True), _grads(engine.model)))
    (m0, g0), (m1, g1) = out
    for key in ("loss", "grad_norm", "tokens", "ratio_mean"):
        assert m0[key] == m1[key], key
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


def test_metrics_average_only_micro_batches_with_model_tokens():
    prompts, responses, fields, masks = _batch()
    engine = _engine(budget=1)  # one sequence per micro-batch

    def loss_fn(log_probs, entropy, mask, f, norm):
        return (log_probs * mask).sum() * 0.0, {"model_tokens": float(mask.sum())}

    metrics = engine.train_step(prompts, responses, {"loss_mask": masks}, loss_fn)
    counts = [int(m.sum()) for m in masks]
    assert metrics["n_micro_batches"] == len(responses)
    assert metrics["model_tokens"] == pytest.approx(sum(counts) / sum(1 for n in counts if n))


def test_micro_batch_mask_is_response_and_loss_mask():
    mb = build_micro_batch([torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4, 5, 6]), torch.tensor([7])],
                           [0, 1], loss_masks=[torch.tensor([True, False, True]), torch.tensor([False])])
    assert mb.targets.tolist() == [[4, 5, 6], [7, 0, 0]]  # the layout does not change
    assert mb.logit_pos[0].tolist() == [1, 2, 3]
    assert mb.mask.tolist() == [[True, False, True], [False, False, False]]


def test_critic_loss_mask_drops_tool_tokens():
    """Value regression: returns on tool tokens (here NaN) are never regressed on."""
    prompts, responses, _, masks = _batch(5, seed=23)
    returns = [torch.linspace(0.0, 1.0, r.numel()) for r in responses]
    nan_returns = [x.masked_fill(~m.bool(), float("nan")) for x, m in zip(returns, masks)]
    critic = _engine(value_head=True)
    got = critic.train_step(prompts, responses, {"returns": nan_returns, "loss_mask": masks}, value_loss)
    ref = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3, micro_batch_tokens=24, grad_clip=0.0),
                     value_head=True)
    values = ref.compute_values(prompts, responses)
    keep = [m.bool() for m in masks]
    expect = sum(((v - x)[k] ** 2).sum() for v, x, k in zip(values, returns, keep)) / sum(int(k.sum()) for k in keep)
    assert got["loss"] == pytest.approx(float(expect), rel=1e-5)
    assert got["tokens"] == sum(int(k.sum()) for k in keep) and got["skipped_nonfinite"] == 0.0


@pytest.mark.parametrize("bad, match", [
    (lambda rs: [torch.full(r.shape, 2) for r in rs], "only 0 and 1"),
    (lambda rs: [torch.full(r.shape, float("nan")) for r in rs], "only 0 and 1"),
    (lambda rs: torch.ones(len(rs)), "must be per-token"),
    (lambda rs: [torch.ones(r.numel() + 1) for r in rs], "'loss_mask', sequence 0"),
])
def test_bad_loss_mask_raises(bad, match):
    prompts, responses, fields, _ = _batch(3, seed=24)
    with pytest.raises(ValueError, match=match):
        _engine().train_step(prompts, responses, {**fields, "loss_mask": bad(responses)}, ppo_loss)



# ------------------------------------------------------------------ the workers hand the mask on
class _FakeQueue:
    """Just enough TransferQueue for ActorWorker.update on one rank: every row, these columns."""

    class Meta(list):
        groups: list

        def part(self, parts, index):  # one rank: its share is every row
            assert (parts, index) == (1, 0)
            return self

    def __init__(self, columns: dict, groups: list[int]):
        self.columns, self.groups = columns, groups

    def get_meta(self, *args, **kwargs):
        meta = self.Meta(range(len(self.groups)))
        meta.groups = list(self.groups)
        return meta

    def get_columns(self, meta, cols):
        return {c: to_column(c, self.columns[c]) for c in cols}  # Columns, as the client's

    def get_batch_columns(self, columns, *args, data_columns=None, **kwargs):  # what a one-rank update reads
        meta = self.get_meta()
        return meta, self.get_columns(meta, data_columns or columns)


def _bare_actor(engine, queue=None):
    """An ActorWorker without a cluster: one rank, the given engine and queue."""
    from asyncflow.config import AlgorithmConfig
    from asyncflow.workers.actor import ActorWorker

    class Bare(ActorWorker):
        rank, dp_rank, dp_size, role, process_group, tq = 0, 0, 1, "actor", None, None

        def __init__(self):
            self.engine, self.tq, self.temperature = engine, queue, 1.0
            self.algo = dataclasses.replace(AlgorithmConfig(), policy_loss="ppo_clip")
            self.cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(seed=0))
    return Bare()


def test_actor_sft_step_masks_become_the_loss_mask():
    from asyncflow.workers.actor_loss import sft_loss_fn

    prompts, targets, _, masks = _batch(5, seed=25)
    as_lists = [[int(x) for x in m] for m in masks]
    got = _bare_actor(_engine()).sft_step([p.tolist() for p in prompts], [t.tolist() for t in targets], as_lists)
    direct = _engine().train_step(prompts, targets, {"loss_mask": masks}, sft_loss_fn)
    plain = _bare_actor(_engine()).sft_step([p.tolist() for p in prompts], [t.tolist() for t in targets])
    assert got["tokens"] == direct["tokens"] == sum(sum(m) for m in as_lists) < plain["tokens"]
    assert got["loss"] == direct["loss"] and got["grad_norm"] == direct["grad_norm"]
    assert got["sft/nll"] == direct["sft/nll"] and plain["loss"] != got["loss"]
    with pytest.raises(ValueError, match="2 masks for 5 targets"):
        _bare_actor(_engine()).sft_step([p.tolist() for p in prompts], [t.tolist() for t in targets], as_lists[:2])


def test_actor_update_reads_the_loss_mask_column():
    from asyncflow.config import AlgorithmConfig
    from asyncflow.workers.actor_loss import policy_loss_fn

    prompts, responses, fields, masks = _batch(6, seed=26)
    columns = {"prompt_ids": prompts, "response_ids": responses, "advantages": fields["advantages"],
               "loss_mask": masks, "scores": torch.arange(6, dtype=torch.float32),
               "gen_version": torch.zeros(6, dtype=torch.long)}
    groups = [0, 0, 0, 1, 1, 1]
    io = {"inputs": ["prompt_ids", "response_ids", "advantages", "scores", "gen_version", "loss_mask"],
          "outputs": []}
    batch = {"rows": 6, "task": "update", "partition": "p", "timeout_s": 1.0}
    got = _bare_actor(_engine(), _FakeQueue(columns, groups)).update(0, batch, io)
    direct = _engine().train_step(prompts, responses, {"advantages": fields["advantages"], "loss_mask": masks},
                                  policy_loss_fn(dataclasses.replace(AlgorithmConfig(), policy_loss="ppo_clip")),
                                  with_entropy=True)
    n_model = sum(int(m.sum()) for m in masks)
    assert got["actor/tokens"] == direct["tokens"] == n_model
    assert got["actor/loss"] == direct["loss"] and got["actor/grad_norm"] == direct["grad_norm"]
    assert got["response_model_tokens"] == n_model and got["response_model_length/mean"] == n_model / 6
    assert got["response_tokens"] == sum(r.numel() for r in responses)  # lengths count tool output too
    io["inputs"].remove("loss_mask")
    plain = _bare_actor(_engine(), _FakeQueue(columns, groups)).update(0, batch, io)
    assert plain["actor/tokens"] == sum(r.numel() for r in responses) and "response_model_tokens" not in plain



def test_critic_update_reads_the_loss_mask_column():
    from asyncflow.config import AlgorithmConfig
    from asyncflow.workers.critic import CriticWorker

    prompts, responses, _, masks = _batch(5, seed=27)
    returns = [torch.linspace(0.0, 1.0, r.numel()) for r in responses]
    columns = {"prompt_ids": prompts, "response_ids": responses, "values": [torch.zeros(r.shape) for r in responses],
               "returns": [x.masked_fill(~m.bool(), float("nan")) for x, m in zip(returns, masks)],
               "loss_mask": masks}

    class Bare(CriticWorker):
        rank, dp_rank, dp_size, tq = 0, 0, 1, None

        def __init__(self):
            self.engine = _engine(value_head=True)
            self.tq = _FakeQueue(columns, list(range(5)))
            self.cfg = types.SimpleNamespace(algorithm=AlgorithmConfig())
    # loss_mask anywhere in the stage's inputs: the other four are read by position
    got = Bare().update(_FakeQueue.Meta(range(5)), {"inputs": ["loss_mask", "prompt_ids", "response_ids", "values",
                                                               "returns"], "outputs": []})
    assert got["critic/tokens"] == sum(int(m.sum()) for m in masks) and got["critic/skipped_nonfinite"] == 0.0
    assert math.isfinite(got["critic/loss"]) and got["critic/loss"] > 0  # the NaN returns on tool tokens: unread
