"""The endpoint live, driven by the official ``openai`` client: agents in threads, in asyncio
and in child processes, through an instance's rollout service (the built-in engine, or a
scripted one where a test needs a known reply, a gated one where it must see a stream while
its request runs). Keys, refusals, limits, request fields, streaming token by token, a client
that goes away, and a trajectory equal to the ``Conversation`` API's on the same episode."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch

# The serve extra (aiohttp) and the official client (openai): CI's first stage installs both
# (requirements-dev.txt) and runs this file; the stage beside verl installs neither extra.
pytest.importorskip("aiohttp")
pytest.importorskip("openai")
import httpx  # openai's own dependency: present once openai is
import openai
from _scripted import GatedEngine, ScriptedEngine

from asyncflow.agents.episode import EpisodeLimits
from asyncflow.agents.runner import EpisodeRunner
from asyncflow.agents.serving.spec import EndpointSpec
from asyncflow.agents.tools import call_tool
from asyncflow.engines.rollout.base import SamplingParams
from asyncflow.engines.rollout.service import RolloutService

CALC = [{"type": "function", "function": {"name": "calculator", "description": "adds", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tok():
    from asyncflow.models.char_tokenizer import build_char_tokenizer
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def builtin(tok):
    """A tiny untrained model on the built-in engine, behind a service and an episode runner."""
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.models.loading import load_causal_lm
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model
    d = build_tiny_model(tempfile.mkdtemp(), TinyModelSpec(hidden_size=64, intermediate_size=128))
    model = load_causal_lm(d)
    # a head that favours '<' and '>', so that the untrained model writes tool calls now and then
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids(["<", ">"])] = 2.5
    model.lm_head = head
    engine = BuiltinRolloutEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.version = 0
    svc = RolloutService(engine, name="builtin-test")
    runner = EpisodeRunner(svc, tok, EpisodeLimits(4, 48, 60.0), name="builtin-test", endpoint=EndpointSpec())
    yield svc, runner
    runner.close()
    svc.close()


def _calc_reply(prompt: str) -> str:
    """Call the calculator on the sum, then answer with what it returned."""
    if prompt.endswith("#"):
        return prompt[:-1].rsplit(">", 1)[1] + "<eos>"
    return "<" + prompt.rsplit("=", 1)[0].rsplit(">", 1)[-1] + ">"


@pytest.fixture(scope="module")
def scripted(tok):
    svc = RolloutService(ScriptedEngine(tok, _calc_reply), name="scripted-test")
    runner = EpisodeRunner(svc, tok, EpisodeLimits(3, 40, 60.0), name="scripted-test", endpoint=EndpointSpec())
    yield svc, runner
    runner.close()
    svc.close()


def calculate(expression: str) -> str:
    """The calculator's output as the Conversation API appends it (an error becomes its message)."""
    return asyncio.run(call_tool("calculator", expression)).text


def _register(fn) -> str:
    mod = types.ModuleType(f"_agents_{fn.__name__}")
    setattr(mod, fn.__name__, fn)
    sys.modules[mod.__name__] = mod
    return f"{mod.__name__}:{fn.__name__}"


def _row(tok, prompt: str, seed: int = 0, answer: str = "") -> dict:
    return {"prompt_ids": tok.encode(prompt, add_special_tokens=False), "prompt": prompt, "answer": answer,
            "seed": seed}


def _client(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


_RUN_PARAMS = SamplingParams(max_new_tokens=16)  # _run's default (one object: _run never changes it)


def _run(runner, fn, rows, params=_RUN_PARAMS, min_version=0):
    path = _register(fn)
    futs = [runner.start(path, row, params, min_version, ("t", fn.__name__, i)) for i, row in enumerate(rows)]
    return [f.result(120) for f in futs]


# ---- the calculator agent on a scripted model: tool calls, streaming, completions ---------------

SEEN: dict = {}


def tool_agent(row, base_url, api_key):
    client = _client(base_url, api_key)
    SEEN["models"] = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=CALC)
    choice = first.choices[0]
    SEEN["first"] = (choice.finish_reason, choice.message.content, first.usage.prompt_tokens)
    call = choice.message.tool_calls[0]
    result = calculate(json.loads(call.function.arguments)["expression"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    # the answer, streamed: the role chunk, the content, the finish reason, the usage
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=CALC, stream=True,
                                                 stream_options={"include_usage": True}))
    SEEN["stream"] = chunks
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return float(answer == row["answer"])


def test_a_tool_calling_agent_gets_openai_tool_calls_and_trains_its_own_tokens(tok, scripted):
    svc, runner = scripted
    t, = _run(runner, tool_agent, [_row(tok, "347+58+906=", answer="1311")])
    assert t.finish_reason == "stop" and t.reward == 1.0, t.error
    assert SEEN["models"] == ["policy"]
    assert SEEN["first"] == ("tool_calls", None, len("347+58+906="))
    stream = SEEN["stream"]
    assert stream[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "stop"
    assert stream[-1].usage.completion_tokens == len("1311") + 1  # and the end-of-sequence token
    # the calc_tool episode's text: the call and the answer trained, the calculator's output not
    assert tok.decode(t.response_ids.tolist(), skip_special_tokens=False) == "<347+58+906>1311#1311<eos>"
    assert t.loss_mask.tolist() == [1] * 12 + [0] * 5 + [1] * 5
    assert t.turn_starts == [0, 17] and t.metrics["tool_calls"] == 1 and t.metrics["turns_off_chain"] == 0
    assert t.token_versions.tolist() == [4] * 22
    # the second request's prompt reused the first turn's tokens and went on from them
    assert svc.engine.prompts[-1] == _row(tok, "347+58+906=")["prompt_ids"] + t.response_ids.tolist()[:17]


def completion_agent(row, base_url, api_key):
    client = _client(base_url, api_key)
    out = client.completions.create(model="policy", prompt=row["prompt"], logprobs=0)
    SEEN["completion"] = out
    return 0.5


def test_plain_completions_are_recorded_too(tok, scripted):
    _, runner = scripted
    t, = _run(runner, completion_agent, [_row(tok, "1+2+3=")])
    out = SEEN["completion"]
    assert out.choices[0].text == "<1+2+3>" and out.choices[0].logprobs.token_logprobs == [-0.25] * 7
    assert t.reward == 0.5 and t.loss_mask.tolist() == [1] * 7


# ---- the built-in engine: the same trajectory as the Conversation API, concurrency ------------

async def conversation_episode(row, ctx):
    """calc_tool's episode (recipes/calc_tool/episode.py)."""
    conv = ctx.start()
    text = await conv.model(stop=">")
    while text.endswith(">") and "<" in text and not conv.done:
        await conv.tool("calculator", text[text.rindex("<") + 1:-1])
        conv.env("#")
        if conv.done:
            break
        text = await conv.model(stop=">")
    return conv.finish(float(text.strip() == ctx.answer))


def calc_agent(row, base_url, api_key):
    """The same episode as an OpenAI-client agent."""
    client = _client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:  # until the model answers or a limit of the episode refuses the request
        try:
            # seed: read and not used (every turn samples with its row's and turn's seed)
            reply = client.chat.completions.create(model="policy", messages=messages, tools=CALC,
                                                   seed=1234).choices[0]
        except openai.BadRequestError as e:  # the episode's token budget is spent
            assert e.code in ("episode_token_limit", "episode_request_limit"), e
            return 0.0
        if not reply.message.tool_calls:
            return float((reply.message.content or "").strip() == row["answer"])
        call = reply.message.tool_calls[0]
        messages += [reply.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": calculate(json.loads(call.function.arguments)["expression"])}]


def test_the_trajectory_equals_the_conversation_apis_on_the_same_episodes(tok, builtin):
    _, runner = builtin
    # prompts of '<' and digits, so that the untrained model writes tool calls in some episodes
    prompts = ["<1+2+3=", "1+2+3=<", "<<<", "12=<", "<9+", "<<"] * 3
    rows = [_row(tok, p, seed=s, answer="6") for s, p in enumerate(prompts)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    path = _register(conversation_episode)
    futs = [runner.start(path, r, params, 0, ("conv", i)) for i, r in enumerate(rows)]
    by_conversation = [f.result(120) for f in futs]
    by_agent = _run(runner, calc_agent, rows, params)
    for a, b in zip(by_agent, by_conversation):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        # the same tokens sampled from the same seeds; their log-probs within float rounding (each was
        # computed in a running batch of other rows)
        assert torch.allclose(a.log_probs, b.log_probs, rtol=0, atol=1e-4)
        assert torch.equal(a.token_versions, b.token_versions)
        assert a.turn_starts == b.turn_starts and a.reward == b.reward
        assert a.metrics["turns"] == b.metrics["turns"]
    called = sum(0 in a.loss_mask.tolist() for a in by_agent)  # the calculator's text in the row, untrained
    assert called >= 1, "no episode called the tool: the test shows little"


async def async_agent(row, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                                 max_tokens=6)
    await client.close()
    return float(len(reply.choices[0].message.content or ""))


def test_concurrent_episodes_share_the_running_batch(tok, builtin):
    svc, runner = builtin
    before = svc.engine.counters["steps"]
    rows = [_row(tok, f"{i}+{i}=", seed=i) for i in range(12)]
    trajs = _run(runner, async_agent, rows[:6]) + _run(runner, calc_agent, rows[6:])
    assert all(t.error is None for t in trajs)
    assert all(t.loss_mask[:1].tolist() == [1] and t.metrics["requests"] >= 1 for t in trajs)
    assert svc.engine.counters["steps"] - before < sum(len(t.response_ids) for t in trajs)  # turns decoded together


CHILD = """
import json, sys, openai
base_url, key, prompt = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=5)
print(json.dumps({"content": r.choices[0].message.content, "tokens": r.usage.completion_tokens}))
"""


def process_agent(row, base_url, api_key):
    out = subprocess.run([sys.executable, "-c", CHILD, base_url, api_key, row["prompt"]], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(json.loads(out.stdout)["tokens"])


def test_agents_in_child_processes(tok, builtin):
    _, runner = builtin
    trajs = _run(runner, process_agent, [_row(tok, "5+5=", seed=1), _row(tok, "7+1=", seed=2)])
    for t in trajs:
        assert t.error is None and t.reward == len(t.response_ids) and 1 <= t.reward <= 5
        assert t.loss_mask.tolist() == [1] * len(t.response_ids)


# ---- keys, refusals, limits ---------------------------------------------------------------------

KEYS: dict = {}


def keep_key_agent(row, base_url, api_key):
    KEYS["key"], KEYS["url"] = api_key, base_url
    _client(base_url, api_key).chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                  "content": row["prompt"]}])
    with pytest.raises(openai.AuthenticationError):  # another episode's key, or none that exists
        _client(base_url, "af-ep-made-up").chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                              "content": "1"}])
    r = httpx.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": "1"}]})
    KEYS["no_key"] = (r.status_code, r.json())
    r = httpx.post(f"{base_url}/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {api_key}"})
    KEYS["bad_json"] = (r.status_code, r.json())
    try:
        _client(base_url, api_key).chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}],
                                                           n=2)
    except openai.BadRequestError as e:
        KEYS["n2"] = e.body
    r = httpx.get(f"{base_url}/nowhere", headers={"Authorization": f"Bearer {api_key}"})
    KEYS["404"] = (r.status_code, r.json())
    return 1.0


def test_keys_are_per_episode_and_refused_once_it_ended(tok, scripted):
    svc, runner = scripted
    t, = _run(runner, keep_key_agent, [_row(tok, "1+1+1=")])
    assert t.error is None and t.metrics["requests"] == 1  # the refused requests recorded nothing
    assert KEYS["no_key"][0] == 401 and KEYS["no_key"][1]["error"]["code"] == "invalid_api_key"
    assert KEYS["bad_json"][0] == 400 and KEYS["bad_json"][1]["error"]["type"] == "invalid_request_error"
    assert KEYS["n2"]["param"] == "n"
    assert KEYS["404"][0] == 404 and "error" in KEYS["404"][1]
    # the episode is over: its key is refused, and nothing it sends reaches the engine
    served = len(svc.engine.prompts)
    with pytest.raises(openai.AuthenticationError):
        _client(KEYS["url"], KEYS["key"]).chat.completions.create(model="policy",
                                                                  messages=[{"role": "user", "content": "2+2+2="}])
    assert len(svc.engine.prompts) == served and len(runner.server.keys) == 0


def greedy_agent(row, base_url, api_key):
    client, n = _client(base_url, api_key), 0
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=CALC).choices[0]
        except openai.BadRequestError as e:
            KEYS["limit"] = e.code
            return float(n)
        n += 1
        messages += [reply.message.model_dump(exclude_none=True), {"role": "user", "content": "1+1="}]


def slow_agent(row, base_url, api_key):
    time.sleep(3.0)
    try:
        _client(base_url, api_key).models.list()
    except openai.AuthenticationError:
        KEYS["late"] = True
    return 1.0


def test_episode_limits_refuse_requests_and_end_late_agents(tok, scripted):
    _, runner = scripted
    t, = _run(runner, greedy_agent, [_row(tok, "1+1+1=")])
    assert KEYS["limit"] == "episode_request_limit" and t.reward == 3 and t.finish_reason == "max_turns"
    assert t.metrics["requests_refused"] == 1
    runner.limits = EpisodeLimits(3, 40, max_time_s=1.0)
    try:
        t, = _run(runner, slow_agent, [_row(tok, "1=")])
    finally:
        runner.limits = EpisodeLimits(3, 40, 60.0)
    assert t.finish_reason == "error" and "before its time limit" in t.error  # nothing to train
    deadline = time.monotonic() + 30
    while "late" not in KEYS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert KEYS.get("late"), "the late agent's key was still accepted"


# ---- a client that goes away mid-stream ----------------------------------------------------------

def disconnect_agent(row, base_url, api_key):
    """Start a streamed request the engine cannot admit yet (staleness bound above the weights
    held), go away after its first chunk, and watch the request leave the engine."""
    body = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "stream": True}
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"}) as r:
        first = next(r.iter_lines())
        KEYS["first_chunk"] = json.loads(first.removeprefix("data: "))
    svc = KEYS["svc"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = svc.stats()
        if s["running"] + s["waiting"] == 0 and s["aborted"] > KEYS["aborted_before"]:
            KEYS["drained"] = True
            break
        time.sleep(0.05)
    return 0.0


def test_a_client_that_disconnects_mid_stream_leaves_no_running_request(tok, builtin):
    svc, runner = builtin
    KEYS["svc"], KEYS["aborted_before"] = svc, svc.stats()["aborted"]
    t, = _run(runner, disconnect_agent, [_row(tok, "3+4=")], min_version=svc.engine.version + 5)
    assert KEYS["first_chunk"]["choices"][0]["delta"]["role"] == "assistant"
    assert KEYS.get("drained"), f"the abandoned request is still on the engine: {svc.stats()}"
    assert t.finish_reason == "error" and "no request answered" in t.error  # nothing recorded


def test_agent_episodes_need_the_endpoint(tok, scripted):
    svc, _ = scripted
    runner = EpisodeRunner(svc, tok, EpisodeLimits(), name="no-endpoint")
    try:
        t, = _run(runner, completion_agent, [_row(tok, "1=")])
    finally:
        runner.close()
    assert t.finish_reason == "error" and "rollout.openai_endpoint.enabled=true" in t.error


# ---- streaming token by token (a gated engine: the test releases each token) ---------------------

STREAM: dict = {}


@pytest.fixture
def gated(tok):
    """A service over an engine that writes "ok<1+2>" (with tools) or "1311<eos>", a token per release."""
    def make(reply: str):
        engine = GatedEngine(tok, reply)
        svc = RolloutService(engine, name="gated-test")
        runner = EpisodeRunner(svc, tok, EpisodeLimits(3, 40, 60.0), name="gated-test", endpoint=EndpointSpec())
        made.append((svc, runner))
        STREAM.clear()
        STREAM["engine"] = engine
        return engine, svc, runner
    made: list = []
    yield make
    for svc, runner in made:
        runner.close()
        svc.close()


def streaming_agent(row, base_url, api_key):
    engine: GatedEngine = STREAM["engine"]
    tools = CALC if row["prompt"].startswith("tools") else None
    stream = _client(base_url, api_key).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], tools=tools, stream=True,
        stream_options={"include_usage": True}, logprobs=True)
    chunks = iter(stream)
    got = [next(chunks)]  # the role chunk: sent before the engine wrote anything
    for _ in range(2):  # each token's text arrives while its request is still running
        engine.release(1)
        got.append(next(chunks))
        STREAM.setdefault("running", []).append(engine.running())
    engine.release(len(engine.reply) - 2)
    STREAM["chunks"] = got + list(chunks)
    return 1.0


def test_a_stream_sends_each_token_as_the_engine_writes_it(tok, gated):
    engine, svc, runner = gated("1311<eos>")
    t, = _run(runner, streaming_agent, [_row(tok, "13+1298=")])
    chunks = STREAM["chunks"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:3]] == ["1", "3"]
    assert all(len(r) == 1 for r in STREAM["running"])  # the request ran on while its first tokens went out
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == "1311"
    assert [c.choices[0].delta.content for c in body[1:5]] == ["1", "3", "1", "1"]  # a chunk per token
    lps = [e.logprob for c in body for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert lps == [-0.5] * 5  # every token's behaviour log-prob, the end-of-sequence token's included
    assert body[-1].choices[0].finish_reason == "stop" and body[-1].system_fingerprint == "asyncflow-v0"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])  # include_usage: null on every chunk but the last
    assert t.error is None and tok.decode(t.response_ids.tolist(), skip_special_tokens=False) == "1311<eos>"
    assert t.loss_mask.tolist() == [1] * 5


def test_a_streamed_tool_call_comes_as_openai_tool_call_chunks(tok, gated):
    engine, svc, runner = gated("ok<1+2>")
    t, = _run(runner, streaming_agent, [_row(tok, "tools: 1+2=")])
    chunks = STREAM["chunks"]
    assert [c.choices[0].delta.content for c in chunks[1:3]] == ["o", "k"]  # content streams ...
    assert all(len(r) == 1 for r in STREAM["running"])
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # ... a call goes out whole once its text is complete: index, id, type, name and arguments
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].type == "function" and calls[0].function.name == "calculator"
    assert json.loads(calls[0].function.arguments) == {"expression": "1+2"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"  # '<1+2>' never as text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert t.metrics["tool_calls"] == 1 and t.loss_mask.tolist() == [1] * 7


def leaving_agent(row, base_url, api_key):
    """Read the role chunk and one token's chunk, then close the connection with the request running."""
    engine: GatedEngine = STREAM["engine"]
    body = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "stream": True}
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"}) as r:
        lines = (x for x in r.iter_lines() if x)
        STREAM["role"] = json.loads(next(lines).removeprefix("data: "))
        engine.release(1)
        STREAM["first"] = json.loads(next(lines).removeprefix("data: "))
        STREAM["running"] = engine.running()
    STREAM["aborted"] = engine.aborted.wait(60)  # set by the engine when it aborts a running request
    return 0.0


def test_a_client_that_leaves_mid_stream_aborts_its_running_request(tok, gated):
    engine, svc, runner = gated("1311<eos>")
    t, = _run(runner, leaving_agent, [_row(tok, "13+1298=")])
    assert STREAM["first"]["choices"][0]["delta"]["content"] == "1" and len(STREAM["running"]) == 1
    assert STREAM["aborted"], "the engine never aborted the request the client left"
    assert engine.running() == [] and svc.stats()["running"] == 0 and not svc._streams and not svc._futures
    assert t.finish_reason == "error" and "no request answered" in t.error  # the aborted turn is not recorded


# ---- request fields, with the official client -------------------------------------------------

FIELDS: dict = {}


def fields_agent(row, base_url, api_key):
    client = _client(base_url, api_key)
    msg = [{"role": "user", "content": row["prompt"]}]
    refused = {}
    for name, kwargs in [("temperature", {"temperature": 0.7}), ("top_p", {"top_p": 0.5}),
                         ("top_logprobs", {"logprobs": True, "top_logprobs": 2}), ("n", {"n": 2}),
                         ("presence_penalty", {"presence_penalty": 1.0}),
                         ("response_format", {"response_format": {"type": "json_object"}}),
                         ("repetition_penalty", {"extra_body": {"repetition_penalty": 1.1}})]:
        try:
            client.chat.completions.create(model="policy", messages=msg, **kwargs)
        except openai.BadRequestError as e:
            refused[name] = (e.param, e.type if hasattr(e, "type") else None, e.message)
    FIELDS["refused"] = refused
    # the run's own values, a seed, and fields that change nothing are accepted
    r = client.chat.completions.create(model="policy", messages=msg, temperature=1.0, top_p=1.0, seed=99, user="u",
                                       logprobs=True, max_tokens=3, tools=CALC)
    FIELDS["capped"] = r
    r = client.chat.completions.create(model="policy", messages=msg, max_completion_tokens=1000, tools=CALC)
    FIELDS["budget"] = r
    r = client.completions.create(model="policy", prompt=row["prompt"], stop=["+"])
    FIELDS["stop"] = r
    return 1.0


def test_request_fields_are_honoured_or_refused_by_name(tok, scripted):
    _, runner = scripted
    long_sum = "+".join(["1"] * 30) + "="  # its call '<1+1+...+1>' is 61 tokens: over the episode's 40
    t, = _run(runner, fields_agent, [_row(tok, long_sum)])
    refused = FIELDS["refused"]
    assert sorted(refused) == sorted(["temperature", "top_p", "top_logprobs", "n", "presence_penalty",
                                      "response_format", "repetition_penalty"])
    assert all(param == name for name, (param, _, _) in refused.items())
    assert "rollout.temperature" in refused["temperature"][2]
    capped = FIELDS["capped"]  # max_tokens honoured: 3 tokens, cut for length, their log-probs
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    assert capped.choices[0].message.content == "<1+" and [e.logprob for e in capped.choices[0].logprobs.content] == [
        -0.25] * 3
    budget = FIELDS["budget"]  # asked for 1000: cut to the episode's 40 tokens
    assert budget.usage.completion_tokens == 40 and budget.choices[0].finish_reason == "length"
    stop = FIELDS["stop"].choices[0]  # stopped at the request's stop string, which the text leaves out
    assert stop.text == "<1" and stop.finish_reason == "stop" and FIELDS["stop"].usage.completion_tokens == 3
    assert t.error is None and t.metrics["requests"] == 3 and t.metrics["requests_refused"] == 0


# ---- the built-in engine: a stream says what the whole reply says --------------------------------

def whole_or_streamed_agent(row, base_url, api_key):
    client = _client(base_url, api_key)
    kwargs = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 12,
              "tools": CALC}
    if row["answer"] == "stream":
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [(tc.function.name, tc.function.arguments) for c in chunks if c.choices
                 for tc in c.choices[0].delta.tool_calls or []]
        STREAM.setdefault("pieces", []).append(sum(bool(c.choices and c.choices[0].delta.content) for c in chunks))
    else:
        m = client.chat.completions.create(**kwargs).choices[0].message
        content, calls = m.content or "", [(tc.function.name, tc.function.arguments) for tc in m.tool_calls or []]
    STREAM[(row["answer"], row["seed"])] = (content, calls)
    return 0.0


def test_a_stream_from_the_builtin_engine_says_what_the_whole_reply_says(tok, builtin):
    _, runner = builtin
    STREAM.clear()
    prompts = ["<1+2+3=", "1+2+3=<", "12=<", "<9+", "7+7=", "<<"]
    for how in ("whole", "stream"):
        _run(runner, whole_or_streamed_agent, [_row(tok, p, seed=s, answer=how) for s, p in enumerate(prompts)],
             SamplingParams(max_new_tokens=12, temperature=1.0))
    for s in range(len(prompts)):
        assert STREAM[("stream", s)] == STREAM[("whole", s)]
    assert max(STREAM["pieces"]) > 1  # content went out in several chunks


# ---- agents in a process of their own ---------------------------------------------------------

def test_an_agent_in_the_agent_process_records_the_same_episode(tok):
    """recipes/calc_agent's agent (importable by its path, as the child needs) on the scripted model, on
    the instance's loop and in the agent process: the same trajectory, the child a process of its own."""
    import os
    path = "recipes.calc_agent.episode:calc_agent"
    out = {}
    for where, spec in (("loop", EndpointSpec()), ("process", EndpointSpec(agent_process=True))):
        svc = RolloutService(ScriptedEngine(tok, _calc_reply), name=f"scripted-{where}")
        runner = EpisodeRunner(svc, tok, EpisodeLimits(3, 40, 60.0), name=f"scripted-{where}", endpoint=spec)
        try:
            row = _row(tok, "347+58+906=", seed=3, answer="1311")
            out[where] = runner.start(path, row, SamplingParams(max_new_tokens=16), 0, ("p", where)).result(120)
            if where == "process":
                assert runner.agent_host is not None and runner.agent_host.pid != os.getpid()
                assert runner.agent_host.alive
        finally:
            runner.close()
            svc.close()
    a, b = out["loop"], out["process"]
    assert a.error is None and b.error is None, (a.error, b.error)
    assert b.reward == a.reward == 1.0 and b.response_ids.tolist() == a.response_ids.tolist()
    assert b.loss_mask.tolist() == a.loss_mask.tolist() and b.metrics == a.metrics


def test_the_agent_process_imports_only_what_its_agents_import(tok):
    """No torch in the child (the instance's process has it): every object an import leaves
    behind is walked again by each full garbage collection there."""
    svc = RolloutService(ScriptedEngine(tok, _calc_reply), name="scripted-imports")
    runner = EpisodeRunner(svc, tok, EpisodeLimits(3, 40, 60.0), name="scripted-imports",
                           endpoint=EndpointSpec(agent_process=True))
    try:
        row = _row(tok, "347+58+906=", seed=3, answer="1311")
        t = runner.start("_agents:torch_in_its_process", row, SamplingParams(max_new_tokens=16), 0, "i").result(120)
    finally:
        runner.close()
        svc.close()
    assert t.error is None, t.error
    assert t.reward == 0.0 and t.metrics["requests"] == 1
