"""The built-in engine driven request by request: continuous batching, per-row independence,
in-flight weight swaps (keep / recompute), the staleness gate at admission, bad input."""
from __future__ import annotations

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from tests.engines._rollout_helpers import EOS, PAD, VOCAB, prompts, tiny_model

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model(tie=False)


def _engine(model, **kw):
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    return BuiltinRolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, **kw)


def _run(engine, requests, submit_every: int = 0, per_step=None) -> dict:
    """Submit requests (all at once, or one every ``submit_every`` steps) and step to the end."""
    pending = list(requests)
    results, step = {}, 0
    if not submit_every:
        for r in pending:
            engine.add_request(r)
        pending = []
    while pending or engine.has_work():
        if pending and step % submit_every == 0:
            engine.add_request(pending.pop(0))
        for r in engine.step():
            results[r.request_id] = r
        if per_step is not None:
            per_step(engine, step)
        step += 1
    return results


def _alone(model, req: GenerationRequest):
    return _run(_engine(model), [req])[req.request_id]


def _assert_as_alone(model, reqs, out) -> None:
    """Each row got the tokens it gets alone (or diverged at a tie), log-probs within 1e-4."""
    for req in reqs:
        alone = _alone(model, req)
        got = out[req.request_id]
        assert _close_or_tied(got.response_ids.tolist(), alone.response_ids.tolist(), got.log_probs, alone.log_probs)
        n = min(len(got.log_probs), len(alone.log_probs))
        assert torch.allclose(got.log_probs[:n], alone.log_probs[:n], atol=1e-4)
        assert got.finish_reason == alone.finish_reason


def _close_or_tied(a, b, lp_a, lp_b) -> bool:
    """Equal tokens, or a divergence where the two best logits tie within fp tolerance."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return abs(float(lp_a[i]) - float(lp_b[i])) < 1e-4
    return len(a) == len(b)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_rows_do_not_depend_on_their_batch(model, params):
    """Rows joining a running batch one by one (slots reused: max 3 running) give each row the
    tokens it gets alone; seeded sampling's log-probs agree within 1e-4."""
    ps = prompts(8, seed=21)
    budgets = [2, 12, 5, 9, 1, 12, 3, 7]
    reqs = [GenerationRequest(i, p, params, seed=100 + i, max_new_tokens=b)
            for i, (p, b) in enumerate(zip(ps, budgets))]
    running = []
    out = _run(_engine(model, max_running_rows=3), reqs, submit_every=2,
               per_step=lambda e, s: running.append(e.stats()["running"]))
    assert max(running) == 3  # the batch filled up, and never went past its limit
    _assert_as_alone(model, reqs, out)


def test_results_come_back_as_rows_finish(model):
    eng = _engine(model, max_running_rows=4)
    reqs = [GenerationRequest(i, p, GREEDY, max_new_tokens=b)
            for i, (p, b) in enumerate(zip(prompts(4, seed=2), [1, 12, 2, 12]))]
    for r in reqs:
        eng.add_request(r)
    first = eng.step()
    assert [r.request_id for r in first] == [0]  # one token budget: done in the step that admitted it
    second = eng.step()
    assert [r.request_id for r in second] == [2]
    assert eng.stats()["running"] == 2


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(model):
    long = torch.randint(2, VOCAB, (29,), generator=torch.Generator().manual_seed(4))
    short = prompts(2, seed=5)
    reqs = [GenerationRequest("a", short[0], GREEDY, max_new_tokens=12),
            GenerationRequest("long", long, GREEDY, max_new_tokens=6),
            GenerationRequest("b", short[1], GREEDY, max_new_tokens=4)]
    eng = _engine(model, prefill_chunk=8)
    seen = []
    out = _run(eng, reqs, per_step=lambda e, s: seen.append((e.stats()["prefilling"], e.stats()["running"])))
    assert (1, 1) in seen  # the long prompt was mid-prefill while row "a" kept decoding
    for r in reqs:
        ref = _alone(model, r)
        assert out[r.request_id].response_ids.tolist() == ref.response_ids.tolist()


@pytest.mark.parametrize("prefill_chunk", [2048, 12], ids=["one_forward", "recompute_in_chunks"])
def test_swap_keep_and_recompute(model, prefill_chunk):
    """A swap mid-generation: rows keep running; tokens after it carry the new version. With
    recompute, the rest of a greedy row equals the new weights run on prompt + tokens so far
    (re-prefilled in one forward, or in several of at most prefill_chunk tokens)."""
    new_model = tiny_model(tie=False, seed=7)
    new_sd = {k: v.clone() for k, v in new_model.state_dict().items()}
    ps = prompts(3, seed=9)
    for mode in ("keep", "recompute"):
        eng = _engine(tiny_model(tie=False))
        for i, p in enumerate(ps):
            eng.add_request(GenerationRequest(i, p, GREEDY, max_new_tokens=10))
        out = {}
        for _ in range(4):
            out.update({r.request_id: r for r in eng.step()})
        eng.prefill_chunk = prefill_chunk  # the prompts came in whole; the recompute may take several forwards
        forwards = []
        prefill = eng._prefill
        eng._prefill = lambda seqs, forwards=forwards, prefill=prefill: (forwards.append(len(seqs)), prefill(seqs))[1]
        eng.load_weights(new_sd, 1, mode)
        if mode == "recompute":
            assert sum(forwards) == 3 and (len(forwards) > 1) == (prefill_chunk < 2048)
        while eng.has_work():
            out.update({r.request_id: r for r in eng.step()})
        fresh = _engine(new_model)
        for i, p in enumerate(ps):
            r = out[i]
            assert r.token_versions.tolist() == [0] * 4 + [1] * (len(r.response_ids) - 4)
            assert r.gen_version == 0
            if mode == "recompute":
                cont = _alone(new_model, GenerationRequest("c", torch.cat([p, r.response_ids[:4]]), GREEDY,
                                                           max_new_tokens=6))
                assert r.response_ids[4:].tolist() == cont.response_ids.tolist()
        assert eng.stats()["swaps"] == 1
        del fresh


def test_admission_waits_for_min_version(model):
    eng = _engine(tiny_model(tie=False))
    eng.add_request(GenerationRequest("old", prompts(1)[0], GREEDY, max_new_tokens=3))
    eng.add_request(GenerationRequest("new", prompts(1, seed=1)[0], GREEDY, max_new_tokens=3, min_version=1))
    done = {}
    for _ in range(5):
        done.update({r.request_id: r for r in eng.step()})
    assert "old" in done and "new" not in done and eng.stats()["waiting"] == 1
    eng.load_weights(dict(eng.model.state_dict()), 1)
    while eng.has_work():
        done.update({r.request_id: r for r in eng.step()})
    assert done["new"].token_versions.tolist() == [1, 1, 1]


def test_bad_requests_fail_alone(model):
    eng = _engine(model, max_context=16)
    good = prompts(2, seed=3, hi=8)
    eng.add_request(GenerationRequest("ok0", good[0], GREEDY, max_new_tokens=4))
    eng.add_request(GenerationRequest("too_long", torch.randint(2, VOCAB, (15,)), GREEDY, max_new_tokens=4))
    eng.add_request(GenerationRequest("bad_ids", torch.tensor([3, VOCAB + 5]), GREEDY, max_new_tokens=4))
    eng.add_request(GenerationRequest("ok1", good[1], GREEDY, max_new_tokens=4))
    out = {}
    while eng.has_work():
        out.update({r.request_id: r for r in eng.step()})
    assert out["too_long"].finish_reason == "error" and "exceeds the context of 16" in out["too_long"].error
    assert out["bad_ids"].finish_reason == "error" and "outside the vocab" in out["bad_ids"].error
    for k, p in (("ok0", good[0]), ("ok1", good[1])):
        alone = _alone(model, GenerationRequest(k, p, GREEDY, max_new_tokens=4))
        assert out[k].response_ids.tolist() == alone.response_ids.tolist()
    assert eng.stats()["errors"] == 2
    with pytest.raises(ValueError, match="already queued or running"):
        eng.add_request(GenerationRequest("x", good[0], GREEDY, max_new_tokens=2))
        eng.add_request(GenerationRequest("x", good[0], GREEDY, max_new_tokens=2))


def test_abort_running_and_unknown(model):
    eng = _engine(model)
    ps = prompts(2, seed=8)
    eng.add_request(GenerationRequest("a", ps[0], GREEDY, max_new_tokens=12))
    eng.add_request(GenerationRequest("b", ps[1], GREEDY, max_new_tokens=12))
    eng.step(), eng.step(), eng.step()
    assert eng.abort("a") is True
    assert eng.abort("nobody") is False
    got = {r.request_id: r for r in eng.step()}
    assert got["a"].finish_reason == "abort" and len(got["a"].response_ids) == 3
    full = _alone(model, GenerationRequest("a", ps[0], GREEDY, max_new_tokens=12))
    assert got["a"].response_ids.tolist() == full.response_ids[:3].tolist()
    s = eng.stats()
    assert s["unknown_aborts"] == 1 and s["aborted"] == 1 and s["running"] == 1


def test_refused_weights_keep_the_old_ones(model):
    eng = _engine(tiny_model(tie=False))
    p = prompts(1, seed=4)[0]
    before = _run(eng, [GenerationRequest(0, p, GREEDY)])[0].response_ids.tolist()
    sd = {k: v.clone() for k, v in tiny_model(tie=False, seed=3).state_dict().items()}
    eng.load_weights(sd, 2)
    changed = _run(eng, [GenerationRequest(1, p, GREEDY)])[1].response_ids.tolist()
    bad_name = {**sd, "model.nope": torch.zeros(1)}
    bad_shape = {**sd, "lm_head.weight": torch.zeros(3, 3)}
    bad_dtype = {k: v.double() for k, v in sd.items()}
    for bad, err in ((bad_name, KeyError), (bad_shape, ValueError), (bad_dtype, TypeError)):
        with pytest.raises(err):
            eng.load_weights(bad, 3)
    with pytest.raises(ValueError, match="older than the version held"):
        eng.load_weights(dict(tiny_model(tie=False).state_dict()), 1)
    assert eng.version == 2
    after = _run(eng, [GenerationRequest(2, p, GREEDY)])[2].response_ids.tolist()
    assert after == changed and (changed != before)


def test_packed_and_shared_prefill_match_rows_run_alone(model):
    """Prompts admitted together are prefilled packed end to end in shared rows, and a group's
    identical prompts are prefilled once; every row still gets the tokens it gets alone."""
    ps = prompts(6, seed=31, lo=3, hi=12)
    group = [ps[0]] * 4  # a GRPO group: one prompt, four rows with their own seeds
    reqs = [GenerationRequest(i, p, SAMPLED, seed=500 + i, max_new_tokens=8) for i, p in enumerate(ps + group)]
    _, places = _engine(model)._prefill([r.prompt_ids for r in reqs])
    assert len({(id(c), row) for c, row, _ in places}) < len(ps)  # several prompts share a packed row
    assert len(set(places[6:] + places[:1])) == 1  # the group's prompt has one place
    eng = _engine(model)
    out = _run(eng, reqs)
    assert eng.stats()["prefill_shared_rows"] == 4
    _assert_as_alone(model, reqs, out)
    assert out[6].response_ids.tolist() != out[7].response_ids.tolist()  # shared prefill, own samples


def test_ignore_eos_runs_every_row_to_its_budget(model):
    """ignore_eos: the engine's EOS no longer stops a row (stop ids still do); rows with and
    without it share a batch and each keeps its own rule."""
    eng = _engine(model)
    eng.eos_token_ids = tuple(range(VOCAB))  # every token is an EOS: any row stops at its first token
    ps = prompts(4, seed=41)
    fixed = SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True)
    reqs = [GenerationRequest(0, ps[0], fixed, seed=1, max_new_tokens=9),
            GenerationRequest(1, ps[1], SAMPLED, seed=2, max_new_tokens=9),
            GenerationRequest(2, ps[2], fixed, seed=3, max_new_tokens=5)]
    out = _run(eng, reqs)
    assert [len(out[i].response_ids) for i in range(3)] == [9, 1, 5]
    assert [out[i].finish_reason for i in range(3)] == ["length", "stop", "length"]
    stop_at = SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=tuple(range(VOCAB)))
    assert len(_run(_engine(model), [GenerationRequest(3, ps[3], stop_at)])[3].response_ids) == 1
