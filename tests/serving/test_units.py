"""The endpoint's parts without a server: per-episode keys and their expiry, the chat formats
(messages -> prompt text, model text -> tool calls, and back), request checks, and the
trajectory rebuilt from recorded turns."""
from __future__ import annotations

import json

import pytest

from asyncflow.agents.episode import EpisodeLimits
from asyncflow.agents.serving.bodies import parse_chat, parse_completion
from asyncflow.agents.serving.chat_format import FormatError, PlainFormat, TemplateFormat
from asyncflow.agents.serving.errors import ApiError
from asyncflow.agents.serving.keys import EpisodeKeys
from asyncflow.agents.serving.limits import LimitExceeded, completion_budget
from asyncflow.agents.serving.recorder import EpisodeRecord, Turn, build_trajectory, chain
from asyncflow.agents.serving.spec import endpoint_spec, is_agent

CALC = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_keys_are_per_episode_and_expire_or_are_revoked():
    clock = Clock()
    keys = EpisodeKeys(clock)
    a, b = keys.issue("episode-a", ttl_s=10), keys.issue("episode-b", ttl_s=30)
    assert a != b and keys.lookup(a) == "episode-a" and keys.lookup(b) == "episode-b"
    assert keys.lookup("af-ep-unknown") is None and keys.lookup("") is None and keys.lookup(None) is None
    clock.now = 110.0  # a's ttl has passed, b's not
    assert keys.lookup(a) is None and keys.lookup(b) == "episode-b"
    keys.revoke(b)
    assert keys.lookup(b) is None and len(keys) == 0
    with pytest.raises(ValueError, match="ttl_s"):
        keys.issue("x", 0)


def test_plain_format_writes_the_calc_episode_text_and_parses_its_calls():
    fmt = PlainFormat()
    reply = fmt.parse("<347+58+906>", CALC)
    assert reply.content is None and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "347+58+906"}
    messages = [{"role": "user", "content": "347+58+906="},
                {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                {"role": "tool", "tool_call_id": call.id, "content": "1311"}]
    text, starts = fmt.render(messages, CALC)
    assert text == "347+58+906=<347+58+906>1311#" and starts == [0, 11, 23]
    assert fmt.stop(CALC) == [">"] and fmt.stop(None) == []
    # no tools offered, or no call written: the text is the content
    assert fmt.parse("<1+2>", None).tool_calls == [] and fmt.parse("1311", CALC).content == "1311"
    # text before a call is the content; it renders back in front of the call
    reply = fmt.parse("ok<1+2>", CALC)
    assert reply.content == "ok" and json.loads(reply.tool_calls[0].arguments) == {"expression": "1+2"}
    again, _ = fmt.render([{"role": "assistant", "content": "ok", "tool_calls": [reply.tool_calls[0].to_openai()]}],
                          CALC)
    assert again == "ok<1+2>"


def test_plain_format_names_the_tool_when_several_are_offered():
    two = CALC + [{"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}]
    fmt = PlainFormat()
    reply = fmt.parse("<echo:hi>", two)
    assert reply.tool_calls[0].name == "echo" and json.loads(reply.tool_calls[0].arguments) == {"text": "hi"}
    assert fmt.parse("<nosuch:hi>", two).tool_calls == []  # an unknown name is text
    text, _ = fmt.render([{"role": "assistant", "tool_calls": [reply.tool_calls[0].to_openai()]}], two)
    assert text == "<echo:hi>"
    with pytest.raises(FormatError, match="role"):
        fmt.render([{"role": "wizard", "content": "x"}], None)
    with pytest.raises(FormatError, match="do not offer"):
        fmt.render([{"role": "assistant", "tool_calls": [reply.tool_calls[0].to_openai()]}], CALC)


class TemplateTok:
    """A tokenizer whose chat template writes `<|role|>content<|end|>`, tool calls as JSON."""
    chat_template = "x"

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        out = ""
        for m in messages:
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls") or [])
            out += f"<|{m['role']}|>{m['content']}{calls}<|end|>"
        return out + ("<|assistant|>" if add_generation_prompt else "")


def test_template_format_parses_json_tool_calls_and_gives_message_boundaries():
    fmt = TemplateFormat(TemplateTok())
    reply = fmt.parse('let me see <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
                      CALC)
    assert reply.content == "let me see" and reply.tool_calls[0].name == "calculator"
    assert json.loads(reply.tool_calls[0].arguments) == {"expression": "1+2"}
    assert fmt.parse("<tool_call>not json</tool_call>", CALC).tool_calls == []
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [reply.tool_calls[0].to_openai()]}]
    text, starts = fmt.render(messages, CALC)
    # the arguments reach the template as a mapping, as chat templates expect
    assert '"arguments": {"expression": "1+2"}' in text and text.endswith("<|assistant|>")
    assert starts == [0, len("<|user|>hi<|end|>")]


def test_request_bodies_are_checked_with_the_failing_parameter():
    req = parse_chat({"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4, "stop": ">",
                      "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.3})
    assert req.max_tokens == 4 and req.stop == [">"] and req.stream and req.include_usage
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user"}], "n": 2}, "n"),
                        ({"messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
                        ({"messages": [{"role": "user"}], "stop": [1]}, "stop"),
                        ({"messages": [{"role": "user"}], "tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(ApiError) as e:
            parse_chat(body)
        assert e.value.status == 400 and e.value.param == param
        assert e.value.body()["error"]["type"] == "invalid_request_error"
    assert parse_completion({"prompt": ["1+1="]}).prompt == "1+1=" and parse_completion({"prompt": [3, 4]}).prompt
    with pytest.raises(ApiError, match="prompt"):
        parse_completion({"prompt": ""})
    with pytest.raises(ApiError, match="JSON object"):
        parse_chat([1, 2])


def test_limits_refuse_requests_past_the_episode_budgets():
    limits = EpisodeLimits(max_turns=2, max_tokens=10)
    assert completion_budget(limits, 0, prompt_len=4, row_prompt_len=4, asked=None, default=16) == 10
    assert completion_budget(limits, 1, prompt_len=11, row_prompt_len=4, asked=2, default=16) == 2
    assert completion_budget(limits, 1, prompt_len=11, row_prompt_len=4, asked=None, default=16) == 3
    with pytest.raises(LimitExceeded) as e:
        completion_budget(limits, 2, 4, 4, None, 16)
    assert e.value.code == "episode_request_limit"
    with pytest.raises(LimitExceeded) as e:
        completion_budget(limits, 1, 14, 4, None, 16)
    assert e.value.code == "episode_token_limit"


def _turn(prompt, completion, version=1, calls=0):
    return Turn(list(prompt), list(completion), [-0.5] * len(completion), [version] * len(completion), "stop",
                tool_calls=calls)


def test_the_trajectory_is_the_chain_of_turns_with_the_model_tokens_trained():
    row = [5, 6, 7]
    t1 = _turn(row, [10, 11], version=2, calls=1)
    side = _turn(row + [99], [42])  # a side request: not on the chain
    t2 = _turn(row + [10, 11, 20, 21], [12, 1], version=3)
    record = EpisodeRecord(row, [t1, side, t2], refused=1)
    assert chain(record.turns) == [t1, t2]
    t = build_trajectory(record, 1.0, EpisodeLimits(max_turns=4, max_tokens=64))
    assert t.response_ids.tolist() == [10, 11, 20, 21, 12, 1]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert t.log_probs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert t.token_versions.tolist() == [2, 2, 2, 2, 3, 3]  # text between turns: the turn before's version
    assert t.turn_starts == [0, 4] and t.reward == 1.0 and t.finish_reason == "stop"
    assert t.metrics["turns"] == 2 and t.metrics["tool_calls"] == 1 and t.metrics["turns_off_chain"] == 1
    assert t.metrics["requests_refused"] == 1
    assert build_trajectory(record, 0.0, EpisodeLimits(max_turns=2)).finish_reason == "max_turns"
    assert build_trajectory(record, 0.0, EpisodeLimits(), "time_limit").finish_reason == "time_limit"
    with pytest.raises(RuntimeError, match="no request answered"):
        build_trajectory(EpisodeRecord(row), 0.0, EpisodeLimits())
    with pytest.raises(RuntimeError, match="row's prompt"):
        build_trajectory(EpisodeRecord(row, [_turn([1, 2, 3], [4])]), 0.0, EpisodeLimits())


def test_agents_are_recognised_by_their_signature_and_the_endpoint_by_its_config():
    async def agent(row, base_url, api_key):
        return 1.0

    def sync_agent(row, base_url, api_key):
        return 1.0

    async def episode(row, ctx):
        return None
    assert is_agent(agent) and is_agent(sync_agent) and not is_agent(episode)
    from asyncflow.config import load_config
    cfg = load_config(None, ["rollout.openai_endpoint.enabled=true", "rollout.openai_endpoint.port=8100"])
    spec = endpoint_spec(cfg, rank=2)
    assert spec.port == 8102 and spec.host == "127.0.0.1" and spec.chat_format == "plain"
    assert endpoint_spec(load_config(None, []), 0) is None


def test_a_request_refused_for_the_token_budget_leaves_its_text_cut_to_the_budget():
    row = [5, 6]
    record = EpisodeRecord(row, [_turn(row, [10, 11])], tail_ids=row + [10, 11, 20, 21, 22, 23])
    t = build_trajectory(record, 0.0, EpisodeLimits(max_turns=4, max_tokens=5))
    assert t.response_ids.tolist() == [10, 11, 20, 21, 22] and t.loss_mask.tolist() == [1, 1, 0, 0, 0]
    assert t.finish_reason == "max_tokens"
    record.tail_ids = [9, 9, 9]  # not this conversation: nothing appended
    assert build_trajectory(record, 0.0, EpisodeLimits(max_turns=4, max_tokens=5)).response_ids.tolist() == [10, 11]


def _read_in_pieces(fmt, text: str, tools, size: int = 1):
    """Feed a reader ``text`` a few characters at a time: what it released after each piece, and the reply."""
    r = fmt.reader(tools)
    out = [r.feed(text[i:i + size]) for i in range(0, len(text), size)]
    *last, reply = r.finish()
    return out + [tuple(last)], reply


@pytest.mark.parametrize("text", ["<347+58+906>", "ok<1+2>", "1311", "a<b<1+2>", "<1+2", ""])
def test_the_plain_reader_releases_content_before_a_call_and_agrees_with_parse(text):
    fmt = PlainFormat()
    pieces, reply = _read_in_pieces(fmt, text, CALC)
    parsed = fmt.parse(text, CALC)
    assert reply.content == parsed.content
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
    released = "".join(c for c, _ in pieces)
    assert released == (reply.content or "")
    calls = [c for _, cs in pieces for c in cs]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in reply.tool_calls]
    if "<" in text:  # nothing after the last '<' goes out before the reply ends
        at = text.rindex("<")
        assert "".join(c for c, _ in pieces[:-1]) == text[:at]


def test_the_template_reader_releases_a_call_when_its_block_closes_and_holds_what_may_open_one():
    fmt = TemplateFormat(TemplateTok())
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    text = "let me see " + call + "\n" + call.replace("1+2", "3*4")
    r = fmt.reader(CALC)
    assert r.feed("let me see <tool") == ("let me see", [])  # the space and the marker's start are held
    content, calls = r.feed(text[len("let me see <tool"):len("let me see ") + len(call)])
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"expression": "1+2"}]  # mid-reply
    content, calls = r.feed(text[len("let me see ") + len(call):])
    assert content == "" and json.loads(calls[0].arguments) == {"expression": "3*4"}
    *_, reply = r.finish()
    assert reply.content == "let me see" and len(reply.tool_calls) == 2
    # whole texts: the same reply either way; a broken block and text without calls are content as written
    for whole in [text, "  plain answer ", "a <tool_call>not json</tool_call> b", "x <tool_c", call]:
        pieces, streamed = _read_in_pieces(fmt, whole, CALC, size=3)
        parsed = fmt.parse(whole, CALC)
        assert streamed.content == parsed.content and len(streamed.tool_calls) == len(parsed.tool_calls)
        assert "".join(c for c, _ in pieces) == (parsed.content or "")
    assert fmt.parse("  plain answer ", CALC).content == "  plain answer "
    assert fmt.parse(call, CALC).content is None


class SplitCharTok:
    """Decodes 'é' only when both of its halves (ids 1, 2) are present, as a byte-level BPE does."""
    def decode(self, ids, skip_special_tokens=True):
        out, i = "", 0
        while i < len(ids):
            if ids[i] == 1:
                out += "é" if i + 1 < len(ids) and ids[i + 1] == 2 else "\ufffd"
                i += 2 if out.endswith("é") else 1
            elif ids[i] == 9:  # a special token
                i += 1
            else:
                out += "abc"[ids[i] - 3] if ids[i] in (3, 4, 5) else "?"
                i += 1
        return out


def test_token_text_holds_half_a_character_and_leaves_out_hidden_stop_tokens():
    pytest.importorskip("aiohttp")
    from asyncflow.agents.serving.streaming import TokenText
    words = TokenText(SplitCharTok(), hidden={5})
    assert words.feed([3]) == "a"
    assert words.feed([1]) == ""  # half of 'é'
    assert words.feed([2, 4]) == "éb"
    assert words.feed([9]) == ""  # a special token has no text
    assert words.feed([5]) == "" and words.finish() == ""  # the request's own stop token: not in the text
    assert TokenText(SplitCharTok()).feed([3, 1]) == "" and TokenText(SplitCharTok()).finish() == ""


def test_request_fields_follow_one_rule_each():
    from asyncflow.agents.serving.bodies import accepted_sampling
    run = accepted_sampling(0.0, 1.0, 0, (1.0, 1.0, 0))  # an evaluation episode of a run sampling at 1.0
    msg = [{"role": "user", "content": "1+1="}]
    # the run's values, the episode's own, or none: accepted (the episode samples with its own)
    for fields in [{}, {"temperature": 1.0}, {"temperature": 0}, {"top_p": 1}, {"top_k": 0}, {"seed": 7},
                   {"user": "u", "metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True},
                   {"n": 1, "top_logprobs": 0, "frequency_penalty": 0, "response_format": {"type": "text"}}]:
        parse_chat({"messages": msg, **fields}, run)
    for fields, param in [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"top_k": 5}, "top_k"),
                          ({"temperature": "hot"}, "temperature"), ({"top_logprobs": 3}, "top_logprobs"),
                          ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                          ({"logit_bias": {"5": 10}}, "logit_bias"),
                          ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"seed": "x"}, "seed"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                          ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"functions": []}, "functions"),
                          ({"stop": [""]}, "stop")]:
        with pytest.raises(ApiError) as e:
            parse_chat({"messages": msg, **fields}, run)
        assert e.value.status == 400 and e.value.param == param, (fields, e.value)
    assert "rollout.temperature" in str(pytest.raises(ApiError, parse_chat, {"messages": msg, "temperature": 0.5},
                                                      run).value)
    assert parse_chat({"messages": msg, "max_tokens": 9, "max_completion_tokens": 4}, run).max_tokens == 4
    assert parse_completion({"prompt": "1", "logprobs": 0}, run).logprobs
    for fields, param in [({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                          ({"suffix": "x"}, "suffix"), ({"messages": msg}, "messages")]:
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "1", **fields}, run)
        assert e.value.param == param


def test_token_text_whole_is_feed_then_finish():
    pytest.importorskip("aiohttp")
    from asyncflow.agents.serving.streaming import TokenText
    for ids in ([3, 1, 2, 4], [3, 1], [1], [9, 5, 3], [5], []):
        fed = TokenText(SplitCharTok(), hidden={5})
        assert TokenText(SplitCharTok(), hidden={5}).whole(ids) == fed.feed(ids) + fed.finish(), ids


class CountingTok:
    """One token per character (its code point); counts the encodes."""
    def __init__(self):
        self.encodes = 0

    def encode(self, text, add_special_tokens=False):
        self.encodes += 1
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_stop_strings_are_encoded_once_per_tokenizer_and_a_long_one_is_refused_every_time():
    pytest.importorskip("aiohttp")
    from asyncflow.agents.serving.session import AgentSession
    from asyncflow.engines.rollout.base import SamplingParams

    def session(tok):
        return AgentSession({"prompt_ids": [ord("1")], "seed": 0}, service=None, tokenizer=tok,
                            chat_format=PlainFormat(), params=SamplingParams(max_new_tokens=8),
                            limits=EpisodeLimits(3, 40, 60.0), min_version=0, request_id="r")
    tok, other = CountingTok(), CountingTok()
    first = session(tok)
    assert first.stop_ids([">", "#"]) == [ord(">"), ord("#")] and tok.encodes == 2
    assert session(tok).stop_ids(["#", ">"]) == [ord("#"), ord(">")] and tok.encodes == 2  # another episode
    assert session(other).stop_ids([">"]) == [ord(">")] and other.encodes == 1  # another tokenizer: its own
    for _ in range(2):
        with pytest.raises(ValueError, match="one token"):
            first.stop_ids(["ab"])
    assert tok.encodes == 4
