"""The training engine and the rollout engine agree on the same weights and tokens.

Pins (fp32, CPU, tiny Qwen2 built once for the module):
- the log-probs the rollout engine returns for its own samples equal the training
  engine's `compute_log_probs` of those tokens at the same temperature (max abs diff
  <= 1e-4), also with top-k / top-p, whose log-probs are under the UNfiltered softmax(logits / T);
- after a real `train_step` and an in-process weight sync (buckets into a staging sink ->
  `load_weights`), the rollout engine's fresh samples have the actor's log-probs,
  while before the sync they did not (so the check can fail);
- the actor's `full_state_dict` of a tied-embedding model loads into the rollout engine
  and into a fresh HF model with no missing/unexpected keys, the tie survives, and the
  rollout engine's greedy output equals `model.generate(do_sample=False)`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from tests.engines._train_helpers import one_thread as _one_thread  # noqa: F401 - autouse, and model_dir's

TOL = 1e-4
N_ROWS = 16
MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, _one_thread) -> Path:
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model

    # Default shape (hidden 128, 2 layers, 4 heads / 2 kv heads, tied embeddings, eager).
    return build_tiny_model(tmp_path_factory.mktemp("engines_agree") / "tiny", TinyModelSpec())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from asyncflow.models.loading import load_tokenizer

    return load_tokenizer(model_dir)


def _rollout(model_dir: Path, tokenizer):
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    from asyncflow.models.loading import load_causal_lm

    return BuiltinRolloutEngine(load_causal_lm(model_dir), eos_token_ids=[tokenizer.eos_token_id],
                                pad_token_id=tokenizer.pad_token_id)


def _actor(model_dir: Path, lr: float = 1e-2):
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.models.loading import load_causal_lm
    from asyncflow.platform import get_platform

    # Explicitly CPU/fp32 (on an accelerator the default would be bf16 autocast); a small
    # token budget so compute_log_probs / train_step run several right-padded micro-batches.
    return FSDPEngine(lambda: load_causal_lm(model_dir), OptimConfig(lr=lr, micro_batch_tokens=64),
                      process_group=None, platform=get_platform("cpu"), mixed_precision=False)


def _prompts(tokenizer, n: int = N_ROWS, seed: int = 0, lo: int = 3, hi: int = 12) -> list[torch.Tensor]:
    """Variable-length prompts of ordinary tokens (no pad / eos), lengths lo..hi."""
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    lengths = [lo + (i % (hi - lo + 1)) for i in range(n)]  # every length in lo..hi appears
    return [ordinary[torch.randint(0, ordinary.numel(), (L,), generator=g)] for L in lengths]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"row {i}: {tuple(x.shape)} vs {tuple(y.shape)}"
        assert x.dtype == torch.float32 and y.dtype == torch.float32, (x.dtype, y.dtype)
    return float(torch.cat([x - y for x, y in zip(a, b)]).abs().max())


def _check_responses(out, n: int = N_ROWS) -> None:
    assert len(out.response_ids) == len(out.log_probs) == len(out.finish_reasons) == n
    lengths = [r.numel() for r in out.response_ids]
    assert all(1 <= L <= MAX_NEW for L in lengths), lengths
    # Enough tokens that the comparison means something (not every row stopped at once).
    assert sum(lengths) >= 3 * n, lengths
    for r, lp in zip(out.response_ids, out.log_probs):
        assert r.dtype == torch.int64 and lp.shape == r.shape
        assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())


# ---------------------------------------------------------------------------------------- 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.9, 0, 0.8)])
def test_sampled_log_probs_match_training_engine(model_dir, tokenizer, temperature, top_k, top_p):
    rollout = _rollout(model_dir, tokenizer)
    actor = _actor(model_dir)
    prompts = _prompts(tokenizer, seed=1)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_k=top_k, top_p=top_p)
    out = rollout.generate(prompts, params, seeds=[1000 + i for i in range(N_ROWS)])
    _check_responses(out)

    lp, ent = actor.compute_log_probs(prompts, out.response_ids, temperature=temperature)
    assert ent is None
    diff = _max_diff(out.log_probs, lp)
    assert diff <= TOL, f"T={temperature} top_k={top_k} top_p={top_p}: max |rollout - actor| log-prob = {diff:.3g}"

    # The comparison has teeth: the log-probs depend on the temperature (and, with top-k /
    # top-p, renormalising over the kept tokens would move them by log(kept mass)).
    if temperature != 1.0:
        wrong, _ = actor.compute_log_probs(prompts, out.response_ids, temperature=1.0)
        assert _max_diff(out.log_probs, wrong) > 1e-2


# ---------------------------------------------------------------------------------------- 2


def _pg_loss(log_probs, entropy, mask, fields, norm):
    """REINFORCE: -A * log pi over response tokens, normalised by the global token count."""
    adv = fields["advantages"][:, None]
    loss = -(adv * log_probs * mask).sum() / norm.num_tokens
    return loss, {}


@pytest.fixture(scope="module")
def trained(model_dir, tokenizer):
    """One real train_step of the actor on samples of a version-0 rollout engine."""
    rollout = _rollout(model_dir, tokenizer)
    actor = _actor(model_dir, lr=1e-2)
    before = {k: v.clone() for k, v in actor.full_state_dict().items()}
    prompts = _prompts(tokenizer, seed=2)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    out0 = rollout.generate(prompts, params, seeds=[2000 + i for i in range(N_ROWS)])
    _check_responses(out0)
    # Rollout and actor agree before training (same weights): a baseline for the test below.
    lp0, _ = actor.compute_log_probs(prompts, out0.response_ids)
    assert _max_diff(out0.log_probs, lp0) <= TOL
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(N_ROWS)])
    metrics = actor.train_step(prompts, out0.response_ids, {"advantages": adv}, _pg_loss)
    return {"rollout": rollout, "actor": actor, "before": before, "prompts": prompts, "out0": out0,
            "params": params, "metrics": metrics}


def test_weight_sync_makes_rollout_match_actor(trained):
    from asyncflow.weight_sync.protocol import make_header
    from asyncflow.weight_sync.send import BucketSender
    from asyncflow.weight_sync.shards import local_tensors
    from asyncflow.weight_sync.sinks import StagingSink

    rollout, actor, prompts, params = trained["rollout"], trained["actor"], trained["prompts"], trained["params"]
    m = trained["metrics"]
    assert actor.step == 1
    assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0, m
    state = actor.full_state_dict()
    change = max(float((state[k] - trained["before"][k]).abs().max()) for k in state)
    assert change > 1e-3, f"train_step changed the weights by at most {change:.3g}"

    # Before the sync the rollout engine (version 0) no longer matches the actor.
    assert rollout.version == 0
    stale, _ = actor.compute_log_probs(prompts, trained["out0"].response_ids)
    assert _max_diff(trained["out0"].log_probs, stale) > 1e-2
    seeds = [3000 + i for i in range(N_ROWS)]
    pre = rollout.generate(prompts, params, seeds=seeds)
    pre_actor, _ = actor.compute_log_probs(prompts, pre.response_ids)
    assert _max_diff(pre.log_probs, pre_actor) > 1e-2

    # The in-process sync path (a rollout instance in the actor's process): the actor's tensors
    # in buckets into a staging sink, then loaded between generations.
    sink = StagingSink(rollout.check_weights)
    named = local_tensors(actor.model)
    header = make_header(named, 1, 1, bucket_bytes=1 << 16, n_sources=1, cast=None)
    BucketSender(0, 0, None, lambda: [sink]).send(header, named)
    got_header, staged = sink.take()
    assert got_header.version == 1 and got_header.seq == 1 and len(header.buckets) > 1
    rollout.load_weights(staged, 1)
    assert rollout.version == 1
    loaded = rollout.model.state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k

    post = rollout.generate(prompts, params, seeds=seeds)
    _check_responses(post)
    post_actor, _ = actor.compute_log_probs(prompts, post.response_ids)
    diff = _max_diff(post.log_probs, post_actor)
    assert diff <= TOL, f"after weight sync: max |rollout - actor| log-prob = {diff:.3g}"


# ---------------------------------------------------------------------------------------- 3


def _hf_greedy(model, prompt: torch.Tensor, max_new: int, eos: int, pad: int) -> torch.Tensor:
    """model.generate's greedy continuation of one unpadded prompt, cut after the first eos."""
    with torch.inference_mode():
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None],
                             do_sample=False, max_new_tokens=max_new, eos_token_id=[eos],
                             pad_token_id=pad)[0, prompt.numel():]
    hit = (out == eos).nonzero()
    return out[: int(hit[0]) + 1] if hit.numel() else out


def test_tied_embeddings_state_dict_loads_and_greedy_matches_hf(trained, model_dir, tokenizer):
    from asyncflow.models.loading import load_causal_lm

    actor = trained["actor"]
    state = actor.full_state_dict()  # after one train_step: not the weights on disk
    # The tie survived training: both names hold the same values.
    assert "model.embed_tokens.weight" in state and "lm_head.weight" in state
    assert torch.equal(state["model.embed_tokens.weight"], state["lm_head.weight"])

    rollout = _rollout(model_dir, tokenizer)
    assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight
    assert set(state) == set(rollout.model.state_dict()), "full_state_dict names != the HF model's names"
    rollout.load_weights(state, 7)  # raises on any unknown / missing / mismatched name
    assert rollout.version == 7
    assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight

    ref = load_causal_lm(model_dir).eval()
    incompatible = ref.load_state_dict(state, strict=True)
    assert not incompatible.missing_keys and not incompatible.unexpected_keys
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    # The reference really holds the trained weights (they differ from the directory's).
    assert not torch.equal(ref.lm_head.weight, trained["before"]["lm_head.weight"])

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    texts = ["12+34=", "7*8=", "abc", "(1+2)*3=", "hello world", "99-5=", "x", "a+b=c"]
    prompts = [torch.tensor(tokenizer(t)["input_ids"], dtype=torch.int64) for t in texts]
    assert all(p.numel() == len(t) for p, t in zip(prompts, texts))  # character-level
    prompts += _prompts(tokenizer, n=8, seed=3)
    out = rollout.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
                           seeds=[0] * len(prompts))
    for i, p in enumerate(prompts):
        want = _hf_greedy(ref, p, MAX_NEW, eos, pad)
        assert out.response_ids[i].tolist() == want.tolist(), f"prompt {i}: {p.tolist()}"
    # Greedy log-probs are under softmax(logits) (temperature 1): the actor's values.
    lp, _ = actor.compute_log_probs(prompts, out.response_ids, temperature=1.0)
    assert _max_diff(out.log_probs, lp) <= TOL
