"""BuiltinRolloutEngine against transformers' own generate / forward on a tiny random Qwen2."""
from __future__ import annotations

import random

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.sampling import SeedKeys, sample_step, vocab_hash
from tests.engines._rollout_helpers import EOS, PAD, VOCAB
from tests.engines._rollout_helpers import prompts as _prompts
from tests.engines._rollout_helpers import ref_log_probs as _ref_log_probs
from tests.engines._rollout_helpers import tiny_model as _tiny_model


@pytest.fixture(scope="module")
def model():
    # Untied: a random model with tied embeddings mostly repeats its last input token,
    # which would make greedy comparisons weak.
    return _tiny_model(tie=False)


@pytest.fixture
def engine(model):
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    return BuiltinRolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD)


def _hf_greedy(model, prompts, max_new: int, eos: list[int]) -> list[torch.Tensor]:
    """model.generate's greedy rows, cut after the first stop token."""
    L = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - p.numel():] = p
        mask[i, L - p.numel():] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=PAD)[:, L:]
    rows = []
    for r in out:
        hit = [j for j, t in enumerate(r.tolist()) if t in eos]
        rows.append(r[: hit[0] + 1] if hit else r)
    return rows


def test_greedy_matches_hf_generate(model, engine):
    prompts = _prompts(20)  # > 16 rows: prefill runs in several length-sorted chunks
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0), seeds=list(range(20)))
    ref = _hf_greedy(model, prompts, 12, [EOS])
    for i, (mine, theirs) in enumerate(zip(out.response_ids, ref)):
        assert mine.dtype == torch.int64 and out.log_probs[i].dtype == torch.float32
        assert mine.tolist() == theirs.tolist(), f"row {i}"
        assert out.finish_reasons[i] == ("stop" if theirs[-1] == EOS else "length")


def test_stop_token_ends_row_and_row_leaves_batch(model, engine, monkeypatch):
    from asyncflow.engines.rollout import slot_cache
    prompts = _prompts(8, seed=3)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    free = engine.generate(prompts, greedy, seeds=[0] * 8)
    stop_tok = int(free.response_ids[2][3])  # row 2 will stop at or before its 4th token
    sizes = []
    real_compact = slot_cache.SlotKVCache.compact
    monkeypatch.setattr(slot_cache.SlotKVCache, "compact", lambda self, keep: (sizes.append(int(keep.sum())),
                                                                              real_compact(self, keep))[1])
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(stop_tok,)),
                          seeds=[0] * 8)
    ref = _hf_greedy(model, prompts, 10, [EOS, stop_tok])
    assert [r.tolist() for r in out.response_ids] == [r.tolist() for r in ref]
    assert out.finish_reasons[2] == "stop" and out.response_ids[2].numel() <= 4
    assert int(out.response_ids[2][-1]) == stop_tok
    assert "length" in out.finish_reasons  # the other rows went on after row 2 left
    assert sizes and sizes[0] < 8 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, temperature=0),
                                    SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5),
                                    SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.8)])
def test_log_probs_match_full_forward(model, engine, params):
    prompts = _prompts(6, seed=5)
    out = engine.generate(prompts, params, seeds=[11, 12, 13, 14, 15, 16])
    for p, r, lp in zip(prompts, out.response_ids, out.log_probs):
        assert r.numel() == lp.numel() > 0
        ref = _ref_log_probs(model, p, r, params.temperature)
        assert (lp - ref).abs().max().item() <= 1e-4


def test_seeding_is_per_prompt(engine):
    prompts = _prompts(10, seed=7)
    seeds = [100 + i for i in range(10)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)
    batch = engine.generate(prompts, params, seeds=seeds)
    singles = [engine.generate([p], params, seeds=[s]) for p, s in zip(prompts, seeds)]
    order = list(range(10))
    random.Random(0).shuffle(order)
    shuffled = engine.generate([prompts[i] for i in order], params, seeds=[seeds[i] for i in order])
    for i in range(10):
        for other, j in [(singles[i], 0), (shuffled, order.index(i))]:
            assert other.response_ids[j].tolist() == batch.response_ids[i].tolist(), f"row {i}"
            assert (other.log_probs[j] - batch.log_probs[i]).abs().max().item() <= 1e-5
    # ... and the seed matters: other seeds give other samples.
    reseeded = engine.generate(prompts, params, seeds=[s + 1 for s in seeds])
    assert [r.tolist() for r in reseeded.response_ids] != [r.tolist() for r in batch.response_ids]


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    prompts = _prompts(6, seed=9)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), seeds=[0] * 6)
    for params in (SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1),
                   SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-6)):
        out = engine.generate(prompts, params, seeds=list(range(6)))
        assert [r.tolist() for r in out.response_ids] == [r.tolist() for r in greedy.response_ids]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_sampling_distribution(top_k, top_p):
    """Gumbel-max over the hashed noise samples the (filtered, renormalised) softmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    rows = 40_000
    keys = SeedKeys(list(range(rows)))
    tokens, lps = sample_step(logits.expand(rows, -1).clone(), temperature=1.0, top_k=top_k, top_p=top_p,
                              keys=keys, step=3, vhash=vocab_hash(8))
    probs = torch.softmax(logits, -1)
    keep = torch.ones(8, dtype=torch.bool)
    if top_k:
        keep = logits >= logits.topk(top_k).values[-1]
    if top_p < 1:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        keep = torch.zeros(8, dtype=torch.bool)
        keep[order[before < top_p]] = True
    target = torch.where(keep, probs, 0.0)
    target /= target.sum()
    freq = torch.bincount(tokens, minlength=8).float() / rows
    assert (freq - target).abs().max().item() < 0.012
    assert torch.allclose(lps, torch.log(probs)[tokens])  # log-probs: the unfiltered softmax


def test_abort_returns_partial_and_continuation_matches(model, engine):
    prompts = _prompts(5, seed=11)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    full = engine.generate(prompts, params, seeds=[0] * 5)
    polls = []

    def should_abort() -> bool:  # polled before prefill and after every decode step
        polls.append(1)
        return len(polls) > 5

    part = engine.generate(prompts, params, seeds=[0] * 5, should_abort=should_abort)
    for i in range(5):
        n = part.response_ids[i].numel()
        assert full.response_ids[i][:n].tolist() == part.response_ids[i].tolist()
        if part.finish_reasons[i] == "abort":
            assert n == 5
    assert "abort" in part.finish_reasons
    todo = [i for i in range(5) if part.finish_reasons[i] == "abort"]
    cont = engine.generate([torch.cat([prompts[i], part.response_ids[i]]) for i in todo], params,
                           seeds=[0] * len(todo), max_new_tokens=[12 - part.response_ids[i].numel() for i in todo])
    for k, i in enumerate(todo):
        joined = torch.cat([part.response_ids[i], cont.response_ids[k]])
        assert joined.tolist() == full.response_ids[i].tolist()
        assert cont.finish_reasons[k] == full.finish_reasons[i]


def test_abort_before_prefill_returns_empty(engine):
    out = engine.generate(_prompts(3), SamplingParams(max_new_tokens=5), seeds=[1, 2, 3], should_abort=lambda: True)
    assert out.finish_reasons == ["abort"] * 3 and all(r.numel() == 0 for r in out.response_ids)


def test_per_row_max_new_tokens(engine):
    prompts = _prompts(4, seed=13)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=50, temperature=0), seeds=[0] * 4,
                          max_new_tokens=[0, 1, 3, 7])
    full = engine.generate(prompts, SamplingParams(max_new_tokens=7, temperature=0), seeds=[0] * 4)
    for i, budget in enumerate([0, 1, 3, 7]):
        n = out.response_ids[i].numel()
        assert n == budget or out.finish_reasons[i] == "stop"
        assert out.response_ids[i].tolist() == full.response_ids[i][:n].tolist()
    assert out.finish_reasons[0] == "length" and out.log_probs[0].numel() == 0


def test_load_weights():
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    eng = BuiltinRolloutEngine(_tiny_model(tie=True, seed=2), eos_token_ids=[EOS], pad_token_id=PAD)
    prompts = _prompts(4, seed=17)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    before = eng.generate(prompts, params, seeds=[0] * 4)
    new = {k: v.clone() for k, v in _tiny_model(tie=True, seed=1).state_dict().items()}
    eng.load_weights(new, version=3)
    assert eng.version == 3
    after = eng.generate(prompts, params, seeds=[0] * 4)
    assert [r.tolist() for r in after.response_ids] != [r.tolist() for r in before.response_ids]
    assert torch.equal(eng.model.model.layers[0].mlp.up_proj.weight, new["model.layers.0.mlp.up_proj.weight"])
    # Tied embeddings: the LM head name may be left out (it is the same tensor).
    eng.load_weights({k: v for k, v in new.items() if k != "lm_head.weight"}, version=4)
    assert eng.version == 4

    with pytest.raises(KeyError, match="model.layers.9.bogus"):
        eng.load_weights({**new, "model.layers.9.bogus": torch.zeros(1)}, version=5)
    bad = dict(new)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.load_weights(bad, version=5)
    with pytest.raises(KeyError, match="model.layers.1.self_attn.q_proj.bias"):
        eng.load_weights({k: v for k, v in new.items() if k != "model.layers.1.self_attn.q_proj.bias"}, version=5)
    assert eng.version == 4  # failed loads change nothing


def test_release_and_resume(engine):
    prompts = _prompts(2)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    ref = engine.generate(prompts, params, seeds=[0, 0])
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(prompts, params, seeds=[0, 0])
    engine.resume_memory()
    again = engine.generate(prompts, params, seeds=[0, 0])
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in ref.response_ids]


def test_bad_arguments_raise(engine):
    prompts = _prompts(2)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, SamplingParams(), seeds=[0])
    with pytest.raises(ValueError, match="outside the vocab"):
        engine.generate([torch.tensor([3, VOCAB + 5])], SamplingParams(), seeds=[0])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate(prompts, SamplingParams(stop_token_ids=(999,)), seeds=[0, 1])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_release_frees_the_kv_cache_and_resume_gives_the_same_samples(engine):
    """memory_held() counts the running batch's KV buffers (polled from inside generate through
    should_abort, before every step); they are kept between calls for the next rows, and
    release_memory drops them (no reference stays). After resume_memory sampling is unchanged."""
    import gc
    import weakref

    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seeds = [11, 12, 13, 14, 15, 16]
    polls: list[int] = []

    def poll() -> bool:
        polls.append(engine.memory_held()["kv_cache"])
        return False

    before = engine.generate(prompts, params, seeds=seeds, should_abort=poll)
    cfg = engine.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    capacity = max(p.numel() + params.max_new_tokens for p in prompts)
    per_row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * capacity * head_dim * 4  # K and V, fp32
    assert polls[0] == 0  # before the first step no cache exists
    assert polls[1] == per_row * len(prompts)  # one slot per row, all admitted in step 1
    assert engine.memory_held()["kv_cache"] == polls[1]  # kept for the next rows
    buffers = [weakref.ref(t) for t in (*engine.batch.cache.keys, *engine.batch.cache.values)]
    weights = engine.memory_held()["weights"]
    assert weights == sum(p.numel() * 4 for p in engine.model.parameters()) + sum(
        b.numel() * b.element_size() for b in engine.model.buffers())

    engine.release_memory()
    gc.collect()
    assert engine.memory_held() == {"weights": weights, "kv_cache": 0}  # weights stay, for weight sync
    assert buffers and all(ref() is None for ref in buffers)
    engine.resume_memory()
    after = engine.generate(prompts, params, seeds=seeds)
    assert [r.tolist() for r in after.response_ids] == [r.tolist() for r in before.response_ids]
    assert all(torch.equal(a, b) for a, b in zip(after.log_probs, before.log_probs))


def _stack_taking(base, name: str | None):
    """A copy of ``base`` whose forward takes the KV cache by ``name`` only (None: by no name;
    its **kwargs swallow whatever else comes), handing it to the real forward by its own name."""
    import copy

    from asyncflow.engines.rollout.builtin import cache_keyword

    stack = copy.deepcopy(base)
    real, theirs = stack.forward, cache_keyword(base)

    def run(input_ids, attention_mask, position_ids, use_cache, cache):
        return real(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=use_cache, **{theirs: cache})

    if name == "past_key_values":
        def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
            return run(input_ids, attention_mask, position_ids, use_cache, past_key_values)
    elif name == "cache":
        def forward(input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):
            return run(input_ids, attention_mask, position_ids, use_cache, cache)
    else:
        def forward(input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
            return run(input_ids, attention_mask, position_ids, use_cache, None)
    stack.forward = forward
    return stack


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_the_kv_cache_goes_by_the_name_the_decoder_takes(model, name):
    """transformers 5.24 renamed the decoder's past_key_values to cache; the engine passes its KV cache
    by the name the stack's forward takes, on either side of the rename (by the other name the cache
    would be swallowed, and the model would fill one of its own: seen on transformers 5.17)."""
    import copy

    from asyncflow.engines.rollout import BuiltinRolloutEngine
    from asyncflow.engines.rollout.builtin import cache_keyword

    prompts, params = _prompts(6), SamplingParams(max_new_tokens=8, temperature=0)
    ref = BuiltinRolloutEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD).generate(
        prompts, params, seeds=list(range(6)))
    other = copy.deepcopy(model)
    other.model = _stack_taking(model.model, name)
    assert cache_keyword(other.model) == name
    out = BuiltinRolloutEngine(other, eos_token_ids=[EOS], pad_token_id=PAD).generate(prompts, params,
                                                                                     seeds=list(range(6)))
    assert [r.tolist() for r in out.response_ids] == [r.tolist() for r in ref.response_ids]

    neither = copy.deepcopy(model)
    neither.model = _stack_taking(model.model, None)
    with pytest.raises(ValueError, match="takes neither 'cache' nor 'past_key_values'"):
        BuiltinRolloutEngine(neither, eos_token_ids=[EOS], pad_token_id=PAD)
