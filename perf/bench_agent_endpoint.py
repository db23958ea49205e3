"""The cost of the OpenAI-compatible endpoint per request: the same episodes (a model
turn up to '>', the calculator's output, a second model turn; greedy) run through the
in-process ``Conversation`` API and through the endpoint by an ``AsyncOpenAI`` agent, on the
built-in engine with the tiny model, one episode at a time (latency) and many at once (the
running batch shared). Reports ms per model request for both, their difference and ratio.
The last line is one JSON object.

    PYTHONPATH=. python perf/bench_agent_endpoint.py [--episodes 32] [--concurrent 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai

from asyncflow.agents.episode import EpisodeLimits
from asyncflow.agents.runner import EpisodeRunner
from asyncflow.agents.serving.spec import EndpointSpec
from asyncflow.agents.tools import call_tool
from asyncflow.engines.rollout.base import SamplingParams

TURNS = 2  # each episode: a tool call, then an answer


async def by_conversation(row, ctx):
    conv = ctx.start()
    await conv.model(stop=">", max_new_tokens=8)
    conv.env((await call_tool("calculator", row["expr"])).text + "#")
    await conv.model(max_new_tokens=8)
    return conv.finish(0.0)


CLIENTS: dict = {}
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


async def by_agent(row, base_url, api_key):
    if base_url not in CLIENTS:  # one connection pool, each episode with its own key (as recipes/calc_agent)
        CLIENTS[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    client = CLIENTS[base_url].with_options(api_key=api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    # the calculator offered: the plain format stops the turn at '>' and keeps it in the reply (a
    # request's own stop strings are left out of the text, and the next turn would not extend this one)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=8)
    result = (await call_tool("calculator", row["expr"])).text
    # the model's reply as it came (content or a call), then the tool's output, as by_conversation appends them
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "c", "content": result}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 0.0


def _engine():
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.engines.rollout.service import RolloutService
    from asyncflow.models.loading import load_causal_lm, load_tokenizer
    from asyncflow.models.tiny import ensure_tiny_model
    d = ensure_tiny_model()
    tok = load_tokenizer(d)
    engine = BuiltinRolloutEngine(load_causal_lm(d), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.version = 0
    return RolloutService(engine, name="bench"), tok


def _register(fn) -> str:
    mod = types.ModuleType(f"_bench_{fn.__name__}")
    setattr(mod, fn.__name__, fn)
    sys.modules[mod.__name__] = mod
    return f"{mod.__name__}:{fn.__name__}"


def _run(runner, path, rows, concurrent: int) -> tuple[float, int]:
    """Wall seconds for every row, ``concurrent`` episodes at a time; model requests made."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    start, turns = time.perf_counter(), 0
    for i in range(0, len(rows), concurrent):
        futs = [runner.start(path, r, params, 0, ("b", path, i + j)) for j, r in enumerate(rows[i:i + concurrent])]
        for f in futs:
            t = f.result(300)
            if t.error:
                raise RuntimeError(t.error)
            if t.metrics["turns"] != TURNS:  # every request on the episode's chain, in both ways
                raise RuntimeError(f"{path}: an episode trained {t.metrics['turns']:.0f} turns, not {TURNS}")
            turns += int(t.metrics["turns"])
    return time.perf_counter() - start, turns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    svc, tok = _engine()
    runner = EpisodeRunner(svc, tok, EpisodeLimits(4, 64, 120.0), name="bench", endpoint=EndpointSpec())
    rows = []
    for i in range(args.episodes):
        expr = f"{100 + i}+{200 + 3 * i}+{7 * i}"
        rows.append({"prompt_ids": tok.encode(expr + "=", add_special_tokens=False), "prompt": expr + "=",
                     "expr": expr, "seed": i})
    paths = {"conversation": _register(by_conversation), "endpoint": _register(by_agent)}
    _run(runner, paths["endpoint"], rows[:4], 4)  # warm: the endpoint starts, the client imports
    _run(runner, paths["conversation"], rows[:4], 4)
    out = {"episodes": args.episodes, "turns_per_episode": TURNS}
    for name, conc in (("sequential", 1), ("concurrent", args.concurrent)):
        best = {}
        for _ in range(args.repeats):  # the best of each: the machine is shared
            for how, path in paths.items():
                wall, turns = _run(runner, path, rows, conc)
                best[how] = min(best.get(how, float("inf")), wall / turns * 1e3)
        out[name] = {"concurrency": conc, "conversation_ms_per_request": round(best["conversation"], 3),
                     "endpoint_ms_per_request": round(best["endpoint"], 3),
                     "overhead_ms": round(best["endpoint"] - best["conversation"], 3),
                     "ratio": round(best["endpoint"] / best["conversation"], 3)}
        print(f"{name:>10} (x{conc}): conversation {best['conversation']:.2f} ms/request, endpoint "
              f"{best['endpoint']:.2f} ms/request, ratio {best['endpoint'] / best['conversation']:.2f}", flush=True)
    runner.close()
    svc.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
