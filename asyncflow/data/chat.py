"""Turn a prompt into chat-formatted text.

The tokenizer's own template when it has one (instruction-tuned checkpoints do);
otherwise a tiny default that spells one "role:content" line per message, the
same layout as the character tokenizer's template.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Message", "apply_chat_template", "default_chat_text", "to_messages"]

Message = dict[str, str]


def to_messages(prompt: str | list[Message], system_prompt: str | None = None) -> list[Message]:
    """A message list from a plain prompt (one user turn) or a message list, with
    the system prompt first unless the messages already start with one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def default_chat_text(messages: list[Message]) -> str:
    """The fallback template, ending with the assistant's turn opened."""
    return "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"


def apply_chat_template(tokenizer: Any, prompt: str | list[Message], system_prompt: str | None = None) -> str:
    """Chat text ready for generation (the assistant turn opened), not tokenized."""
    messages = to_messages(prompt, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return default_chat_text(messages)
