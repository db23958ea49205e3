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
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...data.calc import CALL_CLOSE, CALL_OPEN, RESULT_END

__all__ = ["ChatFormat", "FormatError", "PlainFormat", "Reply", "TemplateFormat", "ToolCall", "make_format",
           "message_text"]


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


class ChatFormat:
    name = ""

    def render(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        """The prompt text, assistant turn opened, and where each message starts in it
        (character offsets; -1 where the template gives no boundary)."""
        raise NotImplementedError

    def stop(self, tools: list[dict] | None) -> list[str]:
        """Stop strings the format adds (one token each)."""
        return []

    def parse(self, text: str, tools: list[dict] | None) -> Reply:
        raise NotImplementedError


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

    def parse(self, text: str, tools: list[dict] | None) -> Reply:
        functions = _functions(tools)
        if functions and text.endswith(CALL_CLOSE) and CALL_OPEN in text:
            at = text.rindex(CALL_OPEN)
            call = self._parse_call(text[at + 1:-1], functions)
            if call is not None:
                return Reply(text[:at] or None, [call])
        return Reply(text, [])

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


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class TemplateFormat(ChatFormat):
    name = "template"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _apply(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        from ...data.chat import default_chat_text
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

    def parse(self, text: str, tools: list[dict] | None) -> Reply:
        calls = []
        for body in _TOOL_CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("name"):
                args = obj.get("arguments", {})
                calls.append(ToolCall(str(obj["name"]), args if isinstance(args, str) else json.dumps(args)))
        if not calls:
            return Reply(text, [])
        rest = _TOOL_CALL.sub("", text).strip()
        return Reply(rest or None, calls)


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
