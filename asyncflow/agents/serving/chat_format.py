"""Chat messages -> the prompt text the model sees, and the model's text -> an OpenAI reply
with ``tool_calls``. Two formats:

- "plain", for the built-in character tokenizer (whose vocabulary has no braces or quotes, so
  no JSON): the messages' texts back to back, as the built-in tasks write their prompts. A tool
  call is written in the calculator task's convention (asyncflow/data/calc.py): ``<ARGS>``
  when the request offers one tool, ``<NAME:ARGS>`` when it offers several, where ARGS is the
  value of the tool's first parameter; generation stops at ``>`` when tools are offered. A
  tool message is its content followed by ``#``. So ``user: 347+58+906=``, then a call of
  ``calculator(expression="347+58+906")``, then the tool's ``1311``, is the text
  ``347+58+906=<347+58+906>1311#``: the calc_tool episode's text, token for token.
- "template", for real checkpoints: the tokenizer's chat template (``apply_chat_template``
  with the request's ``tools``, the assistant turn opened), and tool calls in the convention
  most open-weight chat templates teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The model's text is read as it grows (``ChatFormat.reader``): content goes out as soon as it
cannot be part of a tool call, a call once its text is complete; ``parse`` is the same reader
given the whole text, so a streamed reply and a whole one say the same.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...data.calc import CALL_CLOSE, CALL_OPEN, RESULT_END
from ...data.chat import default_chat_text

__all__ = ["ChatFormat", "FormatError", "PlainFormat", "Reply", "ReplyReader", "TemplateFormat", "ToolCall",
           "make_format", "message_text"]


class FormatError(ValueError):
    """A request the format cannot render (the endpoint answers it with a 400)."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reply:
    content: str | None
    tool_calls: list[ToolCall]


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise FormatError(f"only text content parts are supported, got {p!r:.80}")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise FormatError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _functions(tools: list[dict] | None) -> list[dict]:
    out = []
    for t in tools or []:
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise FormatError(f"a tool must be {{'type': 'function', 'function': {{...}}}}, got {t!r:.80}")
        if not t["function"].get("name"):
            raise FormatError("a tool function needs a name")
        out.append(t["function"])
    return out


class ReplyReader:
    """The model's text fed as it grows: ``feed`` returns the content it may release now and the
    tool calls it completed; ``finish`` the rest and the whole ``Reply``. Released content,
    joined, is the reply's content (or "" where the reply has none)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ToolCall] = []
        self._released: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.text += text
        content, calls = self._read(final=False)
        self._released.append(content)
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall], Reply]:
        content, calls = self._read(final=True)
        self._released.append(content)
        self.calls += calls
        joined = "".join(self._released)
        return content, calls, Reply(joined if joined or not self.calls else None, list(self.calls))

    def _read(self, final: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class ChatFormat:
    name = ""

    def render(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        """The prompt text, assistant turn opened, and where each message starts in it
        (character offsets; -1 where the template gives no boundary)."""
        raise NotImplementedError

    def stop(self, tools: list[dict] | None) -> list[str]:
        """Stop strings the format adds (one token each)."""
        return []

    def reader(self, tools: list[dict] | None) -> ReplyReader:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None) -> Reply:
        """The reply in a whole text (a reader given all of it)."""
        r = self.reader(tools)
        r.feed(text)
        return r.finish()[2]


class PlainFormat(ChatFormat):
    name = "plain"

    def render(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        functions = _functions(tools)
        text, starts = "", []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise FormatError(f"a message must be an object with a role, got {m!r:.80}")
            starts.append(len(text))
            role = m["role"]
            if role in ("system", "developer", "user"):
                text += message_text(m.get("content"))
            elif role == "assistant":
                text += message_text(m.get("content")) + "".join(
                    self._call_text(c, functions) for c in m.get("tool_calls") or [])
            elif role == "tool":
                text += message_text(m.get("content")) + RESULT_END
            else:
                raise FormatError(f"unknown message role {role!r}")
        return text, starts

    def stop(self, tools: list[dict] | None) -> list[str]:
        return [CALL_CLOSE] if tools else []

    def reader(self, tools: list[dict] | None) -> ReplyReader:
        return _PlainReader(self, _functions(tools))

    @staticmethod
    def _first_param(fn: dict) -> str:
        params = fn.get("parameters") or {}
        required = params.get("required") or []
        names = list(required) + [k for k in (params.get("properties") or {}) if k not in required]
        if not names:
            raise FormatError(f"tool {fn['name']!r}: the plain format writes a call's first parameter, and it "
                              "declares none")
        return str(names[0])

    def _parse_call(self, inner: str, functions: list[dict]) -> ToolCall | None:
        fn: dict | None
        if len(functions) == 1:
            fn, args = functions[0], inner
        else:
            name, sep, args = inner.partition(":")
            fn = next((f for f in functions if f["name"] == name), None)
            if not sep or fn is None:
                return None
        return ToolCall(fn["name"], json.dumps({self._first_param(fn): args}))

    def _call_text(self, call: dict, functions: list[dict]) -> str:
        f = call.get("function") or {}
        fn = next((x for x in functions if x["name"] == f.get("name")), None)
        if fn is None:
            raise FormatError(f"an assistant message calls {f.get('name')!r}, which the request's tools do not offer")
        try:
            args = json.loads(f.get("arguments") or "{}")
        except json.JSONDecodeError as e:
            raise FormatError(f"tool call arguments are not JSON: {e}") from None
        value = str(args.get(self._first_param(fn), "")) if isinstance(args, dict) else ""
        return CALL_OPEN + (value if len(functions) == 1 else f"{fn['name']}:{value}") + CALL_CLOSE


class TemplateFormat(ChatFormat):
    name = "template"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _apply(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):  # the data's fallback template
            text = default_chat_text(messages)
            return text if generation else text[:-len("assistant:")]
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation)

    def render(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        _functions(tools)
        msgs = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise FormatError(f"a message must be an object with a role, got {m!r:.80}")
            m = {**m, "content": message_text(m.get("content"))}
            if m.get("tool_calls"):  # templates read the arguments as a mapping
                m["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                      "arguments": _arguments(c.get("function", {}))}}
                                   for c in m["tool_calls"]]
            msgs.append(m)
        try:
            text = self._apply(msgs, tools, True)
            starts = []
            for k in range(len(msgs)):
                head = self._apply(msgs[:k], tools, False) if k else ""
                starts.append(len(head) if text.startswith(head) else -1)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise FormatError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        return text, starts

    def reader(self, tools: list[dict] | None) -> ReplyReader:
        _functions(tools)
        return _TemplateReader()


class _PlainReader(ReplyReader):
    """With tools offered, a call is the text from the last ``<`` to a closing ``>`` that ends the
    reply (generation stops there): the text from the last ``<`` on is held until the end."""

    def __init__(self, fmt: PlainFormat, functions: list[dict]) -> None:
        super().__init__()
        self.fmt, self.functions, self.sent = fmt, functions, 0

    def _read(self, final: bool) -> tuple[str, list[ToolCall]]:
        text = self.text
        at = text.rfind(CALL_OPEN) if self.functions else -1
        if final and at >= 0 and text.endswith(CALL_CLOSE):
            call = self.fmt._parse_call(text[at + 1:-1], self.functions)
            if call is not None:
                out, self.sent = text[self.sent:at], len(text)
                return out, [call]
        end = len(text) if final or at < 0 else at
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out, []


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class _TemplateReader(ReplyReader):
    """Calls are ``<tool_call>{json}</tool_call>`` blocks, anywhere; a block that does not parse
    is content. The whitespace around a call is not content; text that may be the start of a
    block, and whitespace that may precede one, are held until what follows shows which."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0  # text before this is released or consumed as a call
        self.ws = ""  # trailing whitespace of the content, held
        self.after_call = False  # the whitespace after a call is dropped

    def _content(self, c: str) -> str:
        if self.after_call:
            c = c.lstrip()
            if not c:
                return ""
            self.after_call = False
        c = self.ws + c
        body = c.rstrip()
        self.ws = c[len(body):]
        return body

    def _read(self, final: bool) -> tuple[str, list[ToolCall]]:
        out, calls = [], []
        while True:
            rest = self.text[self.sent:]
            i = rest.find(_OPEN)
            if i < 0:
                keep = 0 if final else _partial_suffix(rest, _OPEN)
                out.append(self._content(rest[:len(rest) - keep]))
                self.sent += len(rest) - keep
                break
            j = rest.find(_CLOSE, i)
            if j < 0:  # a block not closed yet (at the end: content)
                out.append(self._content(rest if final else rest[:i]))
                self.sent += len(rest) if final else i
                break
            call = _json_call(rest[i + len(_OPEN):j])
            if call is None:
                out.append(self._content(rest[:j + len(_CLOSE)]))
            else:
                out.append(self._content(rest[:i]))
                self.ws, self.after_call = "", True
                calls.append(call)
            self.sent += j + len(_CLOSE)
        if final and not self.calls and not calls:
            out.append(self.ws)  # no call: the content is the text as written
        return "".join(out), calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not obj.get("name"):
        return None
    args = obj.get("arguments", {})
    return ToolCall(str(obj["name"]), args if isinstance(args, str) else json.dumps(args))


def _arguments(fn: dict) -> Any:
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError as e:
            raise FormatError(f"tool call arguments are not JSON: {e}") from None
    return args


def make_format(name: str, tokenizer: Any) -> ChatFormat:
    if name == "plain":
        return PlainFormat()
    if name == "template":
        return TemplateFormat(tokenizer)
    raise ValueError(f"unknown chat format {name!r} (plain | template)")
