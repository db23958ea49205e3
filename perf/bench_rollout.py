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
any model runs: on a shared 2-core machine one thread is steadier, and FACTS.md measured
two threads barely helping generation at these sizes.

    python perf/bench_rollout.py [--quick] [--threads N]

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


def run_hf(model, prompts: list, seed: int) -> tuple[int, float]:
    import torch
    ids, mask = left_pad(prompts)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD)
    dt = time.perf_counter() - t0
    gen = out[:, ids.shape[1]:]
    return sum(count_until_eos(r) for r in gen), dt


def run_builtin(engine, prompts: list, seed: int) -> tuple[int, float]:
    from asyncflow.engines.rollout import SamplingParams
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
    seeds = [seed * 100_003 + i for i in range(len(prompts))]
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds=seeds)
    dt = time.perf_counter() - t0
    return sum(count_until_eos(r) for r in out.response_ids), dt


def bench_case(case: Case, rounds: int) -> dict:
    from asyncflow.engines.rollout import BuiltinRolloutEngine
    model = build_model(case)
    prompts = make_prompts(case.batch)
    b = raise_eos(model, make_prompts(64, seed=1), EOS_RATE)
    engine = BuiltinRolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD)
    methods = {"builtin": lambda s: run_builtin(engine, prompts, s), "hf_generate": lambda s: run_hf(model, prompts, s)}
    for f in methods.values():  # warm-up: first calls allocate and fill caches
        f(12345)
    tps: dict[str, list[float]] = {m: [] for m in methods}
    toks: dict[str, list[int]] = {m: [] for m in methods}
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))  # alternate who goes first
        for m in order:
            n, dt = methods[m](r)
            tps[m].append(n / dt)
            toks[m].append(n)
    med = statistics.median
    res = {"case": case.name, "eos_bias": round(b, 3),
           "builtin_tokens_per_s": med(tps["builtin"]), "hf_generate_tokens_per_s": med(tps["hf_generate"]),
           "builtin_mean_len": statistics.mean(toks["builtin"]) / case.batch,
           "hf_mean_len": statistics.mean(toks["hf_generate"]) / case.batch}
    res["ratio_builtin_vs_hf"] = res["builtin_tokens_per_s"] / res["hf_generate_tokens_per_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases and rounds; about two minutes on 2 cores")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    if args.quick:
        cases, rounds = [Case(128, 2, 4, 2, 128), Case(256, 4, 4, 2, 64)], 3
    else:
        cases, rounds = [Case(128, 2, 4, 2, 64), Case(128, 2, 4, 2, 256), Case(256, 4, 4, 2, 64),
                         Case(256, 4, 4, 2, 256)], 5
    t0 = time.time()
    results = [bench_case(c, rounds) for c in cases]
    print(f"tokens/s, median of {rounds} interleaved rounds; temperature 1, max_new_tokens {MAX_NEW_TOKENS}, "
          f"prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, EOS rate ~{EOS_RATE:.3f}/token, {args.threads} thread(s)")
    print(f"{'case':16} {'builtin':>9} {'generate':>9} {'ratio':>6} {'len builtin':>12} {'len generate':>13}")
    for r in results:
        print(f"{r['case']:16} {r['builtin_tokens_per_s']:9.0f} {r['hf_generate_tokens_per_s']:9.0f} "
              f"{r['ratio_builtin_vs_hf']:6.2f} {r['builtin_mean_len']:12.1f} {r['hf_mean_len']:13.1f}")
    head = results[0]  # headline: the model size the learning runs use (h128/2L)
    summary = {"builtin_tokens_per_s": round(head["builtin_tokens_per_s"], 1),
               "hf_generate_tokens_per_s": round(head["hf_generate_tokens_per_s"], 1),
               "ratio_builtin_vs_hf": round(head["ratio_builtin_vs_hf"], 3),
               "ratio_min_over_cases": round(min(r["ratio_builtin_vs_hf"] for r in results), 3),
               "cases": results, "threads": args.threads, "quick": args.quick}
    for extra in EXTRA_RESULTS:
        summary.update(extra(args))
    summary["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
