"""Shared pieces of the training-engine tests: a tiny Qwen2, batches, loss functions and
the body of the spawned 2-rank children (importable by `spawn`)."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor

VOCAB = 64


def tiny_model(seed: int = 0, tie: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
                      max_position_embeddings=128, attn_implementation="eager")
    return Qwen2ForCausalLM(cfg)


def make_batch(n: int, seed: int, max_prompt: int = 6, max_response: int = 9):
    """n (prompt, response) pairs of random lengths, with per-token and per-sequence fields."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n):
        plen = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        rlen = int(torch.randint(1, max_response + 1, (1,), generator=g))
        prompts.append(torch.randint(0, VOCAB, (plen,), generator=g))
        responses.append(torch.randint(0, VOCAB, (rlen,), generator=g))
    fields = {
        "advantages": [torch.randn(r.shape, generator=g) for r in responses],
        "old_log_probs": [-torch.rand(r.shape, generator=g) * 4 for r in responses],
        "seq_weight": torch.rand(n, generator=g),
    }
    return prompts, responses, fields


def loss_masks_for(responses: list[Tensor], seed: int) -> list[Tensor]:
    """Multi-turn-like loss masks (int8, 1 = model token): each row of 3+ tokens has a tool span
    strictly inside it (model tokens before and after), row 1 is all tool output."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, r in enumerate(responses):
        m = torch.ones(r.numel(), dtype=torch.int8)
        if i == 1:
            m.zero_()
        elif r.numel() >= 3:
            a = int(torch.randint(1, r.numel() - 1, (1,), generator=g))
            b = int(torch.randint(a + 1, r.numel(), (1,), generator=g))
            m[a:b] = 0
        out.append(m)
    return out


def split_batch(prompts, responses, fields, idx: list[int]):
    sub = {k: (v[torch.tensor(idx)] if isinstance(v, Tensor) else [v[i] for i in idx]) for k, v in fields.items()}
    return [prompts[i] for i in idx], [responses[i] for i in idx], sub


def ppo_loss(log_probs, entropy, mask, fields, norm):
    """A PPO-clip-like loss using per-token fields, a per-sequence field and entropy,
    normalised by the global counts."""
    ratio = torch.exp(log_probs - fields["old_log_probs"])
    adv = fields["advantages"]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = (pg * mask).sum() / norm.num_tokens
    loss = loss + 0.1 * (fields["seq_weight"] * (log_probs * mask).sum(-1)).sum() / norm.num_seqs
    if entropy is not None:
        loss = loss - 0.01 * (entropy * mask).sum() / norm.num_tokens
    return loss, {"ratio_mean": float((ratio.detach() * mask).sum() / mask.sum().clamp(min=1))}


def value_loss(values, entropy, mask, fields, norm):
    err = (values - fields["returns"]) ** 2
    return (err * mask).sum() / norm.num_tokens, {}


# ------------------------------------------------------------------ spawned 2-rank children
GLOBAL_N = 7
RANK_SHARES = {0: [0, 1, 2, 3, 4], 1: [5, 6]}  # uneven on purpose
BUDGETS = {"big": 100_000, "tiny": 8}


def spawn_ranks(child, world: int, workdir: Path, timeout: float) -> list[dict]:
    """Runs ``child(rank, world, str(workdir))`` in ``world`` spawned processes (any still alive
    when this fails is killed) and returns what each rank saved, none of which may be an error."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=child, args=(r, world, str(workdir))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout)
            assert p.exitcode == 0, f"child {p.pid} exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = [torch.load(Path(workdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def _run_rank(rank: int, world: int, workdir: str, body) -> None:
    """One spawned rank: one thread, a gloo group of all ranks, then ``body(rank, group, workdir)``;
    rank r writes the dict it returns (or the traceback of its failure) to workdir/rank{r}.pt."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        out = body(rank, group, Path(workdir))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"error": traceback.format_exc()}
    torch.save(out, Path(workdir) / f"rank{rank}.pt")


def dist_child(rank: int, world: int, workdir: str) -> None:
    """Runs every 2-rank scenario; rank r writes its results to workdir/rank{r}.pt."""
    _run_rank(rank, world, workdir, _dist_scenarios)


def _dist_scenarios(rank: int, group, workdir: Path) -> dict:
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.platform import get_platform

    out: dict = {}
    platform = get_platform("cpu")
    prompts, responses, fields = make_batch(GLOBAL_N, seed=1)
    mine = split_batch(prompts, responses, fields, RANK_SHARES[rank])
    for name, budget in BUDGETS.items():
        cfg = OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=budget)
        # Different seed per rank: the engine must broadcast rank 0's weights.
        engine = FSDPEngine(lambda: tiny_model(seed=rank), cfg, process_group=group, platform=platform)
        metrics = engine.train_step(*mine, ppo_loss, with_entropy=True)
        lp, _ = engine.compute_log_probs(mine[0], mine[1])
        out[name] = {"metrics": metrics, "state": engine.full_state_dict(), "log_probs": lp}

    # Checkpoint: step, save, step  vs  fresh engine, load, step.
    p2, r2, f2 = make_batch(GLOBAL_N, seed=2)
    second = split_batch(p2, r2, f2, RANK_SHARES[rank])
    cfg = OptimConfig(lr=1e-3, warmup_steps=3, micro_batch_tokens=24)
    a = FSDPEngine(lambda: tiny_model(seed=0), cfg, process_group=group, platform=platform)
    a.train_step(*mine, ppo_loss)
    a.save_checkpoint(Path(workdir) / "ckpt", extra={"data_pos": 7})
    a_rand = torch.rand(3)  # what the RNG gives right after the save
    a_metrics = a.train_step(*second, ppo_loss)
    a_state = a.full_state_dict()
    torch.manual_seed(999)
    b = FSDPEngine(lambda: tiny_model(seed=5), cfg, process_group=group, platform=platform)
    extra = b.load_checkpoint(Path(workdir) / "ckpt")
    b_rand_after_load = torch.rand(3)
    b_metrics = b.train_step(*second, ppo_loss)
    out["ckpt"] = {"a_metrics": a_metrics, "b_metrics": b_metrics, "a_state": a_state,
                   "b_state": b.full_state_dict(), "extra": extra, "b_step": b.step,
                   "a_rand": a_rand, "b_rand": b_rand_after_load,
                   "rank_files": sorted(os.listdir(Path(workdir) / "ckpt" / "rng"))}
    out["loss_mask"] = _loss_mask_scenario(rank, group, platform)
    out["nonfinite"] = _nonfinite_scenario(rank, group, platform, mine)
    out["ckpt_fail"] = _failed_save_scenario(rank, a, Path(workdir) / "ckpt")
    return out


def loss_mask_batch():
    """The global batch of the 2-rank loss-mask scenario: make_batch(GLOBAL_N, seed=1) with
    tool spans (row 1, on rank 0, all tool output)."""
    prompts, responses, fields = make_batch(GLOBAL_N, seed=1)
    fields["loss_mask"] = loss_masks_for(responses, seed=1)
    return prompts, responses, fields


def _loss_mask_scenario(rank: int, group, platform) -> dict:
    """One masked step on RANK_SHARES; the parent compares it with a 1-rank step."""
    from asyncflow.engines.train import FSDPEngine, OptimConfig

    norms = []

    def loss_fn(log_probs, entropy, mask, fields, norm):
        norms.append((norm.num_tokens, norm.num_seqs))
        return ppo_loss(log_probs, entropy, mask, fields, norm)
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=24)
    engine = FSDPEngine(lambda: tiny_model(seed=0), cfg, process_group=group, platform=platform)
    metrics = engine.train_step(*split_batch(*loss_mask_batch(), RANK_SHARES[rank]), loss_fn, with_entropy=True)
    return {"metrics": metrics, "norms": norms, "state": engine.full_state_dict()}


def nan_on_rank1(rank: int):
    """ppo_loss, but NaN on rank 1 only: one bad rank must make every rank skip."""
    def loss_fn(log_probs, entropy, mask, fields, norm):
        loss, metrics = ppo_loss(log_probs, entropy, mask, fields, norm)
        return (loss * float("nan") if rank == 1 else loss), metrics
    return loss_fn


def _nonfinite_scenario(rank: int, group, platform, batch) -> dict:
    """good step, NaN step (skipped), NaN step again (limit 2: raises)."""
    from asyncflow.engines.train import FSDPEngine, NonFiniteUpdateError, OptimConfig

    cfg = OptimConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=24, max_nonfinite_in_row=2)
    e = FSDPEngine(lambda: tiny_model(seed=0), cfg, process_group=group, platform=platform)
    good = e.train_step(*batch, ppo_loss)
    before = e.full_state_dict()
    moments = {k: v.clone() for k, v in e.optimizer.state[next(iter(e.model.parameters()))].items()
               if isinstance(v, Tensor) and v.dim() > 0 and not hasattr(v, "full_tensor")}
    lr_before = e.scheduler.get_last_lr()[0]
    bad = e.train_step(*batch, nan_on_rank1(rank))
    after = e.full_state_dict()
    moments_after = {k: v.clone() for k, v in e.optimizer.state[next(iter(e.model.parameters()))].items()
                     if k in moments}
    error = ""
    try:
        e.train_step(*batch, nan_on_rank1(rank))
    except NonFiniteUpdateError as exc:
        error = str(exc)
    return {"good": good, "bad": bad, "step": e.step, "lr_same": lr_before == e.scheduler.get_last_lr()[0],
            "weights_same": all(torch.equal(before[k], after[k]) for k in before),
            "moments_same": all(torch.equal(moments[k], moments_after[k]) for k in moments), "error": error}


def _failed_save_scenario(rank: int, engine, path: Path) -> dict:
    """Rank 1 cannot write (the OS refuses: RLIMIT_FSIZE, as with a full disk); the
    checkpoint already at ``path`` must stay byte for byte as it was."""
    import hashlib
    import resource

    def digest() -> dict:
        return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(path.rglob("*")) if f.is_file()}
    before = digest()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
    error = ""
    try:
        engine.save_checkpoint(path, extra={"data_pos": 99})
    except RuntimeError as exc:
        error = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    leftovers = sorted(p.name for p in path.parent.iterdir() if p.name.startswith("."))
    return {"error": error, "same": before == digest() and bool(before), "leftovers": leftovers}


def fsdp2_move_child(rank: int, world: int, workdir: str) -> None:
    """The 2-rank child of test_train_offload; rank r writes what it saw to workdir/rank{r}.pt."""
    _run_rank(rank, world, workdir, _fsdp2_move)


def _fsdp2_move(rank: int, group, workdir: Path) -> dict:
    """FSDP2 (DTensor parameters and optimizer state) through move_train_state: to the same
    device (nothing moves), then one way to 'meta', the only other device a CPU machine has."""
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.engines.train.base import move_train_state
    from asyncflow.platform import get_platform

    out: dict = {}
    engine = FSDPEngine(lambda: tiny_model(seed=0), OptimConfig(lr=1e-3), process_group=group,
                        platform=get_platform("cpu"))
    prompts, responses, fields = make_batch(6, seed=1)
    engine.train_step(*split_batch(prompts, responses, fields, [rank, rank + 2, rank + 4]), ppo_loss)
    params = list(engine.model.parameters())
    out["dtensor"] = all(hasattr(p, "to_local") for p in params)
    out["same_device"] = move_train_state(engine.model, engine.optimizer, "cpu")
    local = [p.to_local() for p in params] + [p.grad.to_local() for p in params if p.grad is not None]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
    out["expected"] = (sum(t.numel() * t.element_size() for t in local)
                       + sum(v.to_local().numel() * v.element_size() for v in state)
                       + sum(b.numel() * b.element_size() for b in engine.model.buffers()))
    out["moved"] = move_train_state(engine.model, engine.optimizer, "meta")
    now = list(engine.model.parameters())
    out["devices"] = sorted({str(p.to_local().device) for p in now}
                            | {str(p.grad.to_local().device) for p in now if p.grad is not None}
                            | {str(v.device) for s in engine.optimizer.state.values()
                               for v in s.values() if v.dim() > 0})
    out["steps_on"] = sorted({str(s["step"].device) for s in engine.optimizer.state.values()})
    in_opt = [p for g in engine.optimizer.param_groups for p in g["params"]]
    out["optimizer_follows"] = (len(in_opt) == len(now) and all(a is b for a, b in zip(in_opt, now))
                                and {id(p) for p in engine.optimizer.state} == {id(p) for p in now})
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: a second thread only adds contention. A test
    module uses it with ``from tests.engines._train_helpers import one_thread as _one_thread``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
