"""Offloading a training engine (colocated roles): move_train_state and FSDPEngine.offload/onload.

A CPU machine has one real device, so a move is checked two ways: to the same device (it must
move nothing and touch nothing), and one way to 'meta' (a different device: every tensor must
arrive there and be counted once; 'meta' holds no data, so no round trip). The 2-rank test does
the same with FSDP2's DTensor parameters and optimizer state.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncflow.engines.train import FSDPEngine, OptimConfig
from asyncflow.engines.train.base import move_train_state
from tests.engines._train_helpers import fsdp2_move_child, make_batch, ppo_loss, spawn_ranks, tiny_model


class _TiedLM(nn.Module):
    """Tied embedding/head (one Parameter under two names), a norm with buffers, a plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)  # running stats: float buffers and a 0-dim int64 counter
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.norm(self.emb(ids))))


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model after one AdamW step: gradients and optimizer state exist."""
    torch.manual_seed(0)
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 10, (8,))).logsumexp(-1).mean().backward()
    opt.step()
    return model, opt


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_a_move_to_the_same_device_moves_nothing():
    model, opt = _stepped()
    params = list(model.parameters())
    tensors = [*params, *(p.grad for p in params), *model.buffers(),
               *(v for s in opt.state.values() for v in s.values())]
    ptrs = [t.data_ptr() for t in tensors]
    assert move_train_state(model, opt, torch.device("cpu")) == 0
    assert move_train_state(model, opt, "cpu") == 0
    assert all(a is b for a, b in zip(params, model.parameters()))
    now = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
           *(v for s in opt.state.values() for v in s.values())]
    assert all(a is b for a, b in zip(tensors, now)) and [t.data_ptr() for t in now] == ptrs


def test_a_move_to_another_device_takes_every_tensor_once():
    model, opt = _stepped()
    params = list(model.parameters())  # the tied weight once
    assert len(params) == 5
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    expected = _nbytes(params) + _nbytes(p.grad for p in params) + _nbytes(model.buffers()) + _nbytes(state)
    assert move_train_state(model, opt, "meta") == expected
    now = list(model.parameters())
    on = {t.device.type for t in [*now, *(p.grad for p in now), *model.buffers()]}
    on |= {v.device.type for s in opt.state.values() for v in s.values() if v.dim() > 0}
    assert on == {"meta"}
    assert {s["step"].device.type for s in opt.state.values()} == {"cpu"}  # scalar bookkeeping stays
    assert model.head.weight is model.emb.weight  # still tied
    # By default torch makes new Parameter objects for cpu -> meta: the helper must keep the old
    # ones, which the optimizer steps and keys its state by.
    assert all(a is b for a, b in zip(params, now))
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_opt) == len(now) and all(a is b for a, b in zip(in_opt, now))
    assert {id(p) for p in opt.state} == {id(p) for p in now}
    assert move_train_state(model, opt, "meta") == 0  # already there


def test_fsdp_engine_offload_on_cpu_frees_the_gradients_and_changes_no_step():
    """On the CPU nothing moves; the last step's gradients are dropped (the next train_step
    starts from none anyway), so training goes on exactly as without the offload."""
    engines = [FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3)) for _ in range(2)]
    batches = [make_batch(5, seed=s) for s in (1, 2)]
    first = [e.train_step(*batches[0], ppo_loss) for e in engines]
    assert first[0] == first[1]
    grads = [p.grad for p in engines[0].model.parameters()]
    assert all(g is not None for g in grads)
    assert engines[0].offload() == 0
    assert all(p.grad is None for p in engines[0].model.parameters())
    assert engines[0].onload() == 0
    second = [e.train_step(*batches[1], ppo_loss) for e in engines]
    assert second[0] == second[1]
    a, b = (e.full_state_dict() for e in engines)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.both_stacks
def test_fsdp2_dtensor_parameters_and_optimizer_state_move(tmp_path):
    for out in spawn_ranks(fsdp2_move_child, 2, tmp_path, timeout=180):
        assert out["dtensor"] and out["same_device"] == 0
        assert out["moved"] == out["expected"] > 0
        assert out["devices"] == ["meta"] and out["steps_on"] == ["cpu"]
        assert out["optimizer_follows"]
