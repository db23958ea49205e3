"""Chat formatting: the tokenizer's template when present, the tiny default otherwise."""
from __future__ import annotations

from asyncflow.data import apply_chat_template, default_chat_text, to_messages


class _NoTemplate:
    chat_template = None


def test_to_messages_adds_system_once():
    assert to_messages("hi") == [{"role": "user", "content": "hi"}]
    assert to_messages("hi", "be brief")[0] == {"role": "system", "content": "be brief"}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert to_messages(msgs, "other") == msgs


def test_default_template_when_tokenizer_has_none():
    assert apply_chat_template(_NoTemplate(), "1+1=", "add") == "system:add\nuser:1+1=\nassistant:"
    assert default_chat_text([{"role": "user", "content": "x"}]) == "user:x\nassistant:"


def test_tokenizer_template_is_used(char_tok):
    char_tok_copy = char_tok
    original = char_tok_copy.chat_template
    try:
        char_tok_copy.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        assert apply_chat_template(char_tok_copy, "1+1=") == "<1+1=>"
    finally:
        char_tok_copy.chat_template = original
