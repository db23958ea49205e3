"""The character tokenizer gives the same ids through every loader, one id per character."""
from __future__ import annotations

import json

import pytest

from asyncflow.models.char_tokenizer import (
    CHARS,
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN2_SPLIT_REGEX,
    build_char_tokenizer,
    char_vocab,
    unsupported_chars,
)


def _addition_strings() -> list[str]:
    prompts = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    answers = [f"{s}{EOS_TOKEN}" for s in range(199)]
    return prompts + answers


def test_our_regex_is_the_one_qwen2_tokenizer_imposes():
    from transformers.models.qwen2 import tokenization_qwen2

    assert QWEN2_SPLIT_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_vocab_is_small_and_one_token_per_character():
    tok = build_char_tokenizer()
    assert 45 <= len(tok) <= 60
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 0
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 1
    assert len(tok) == len(char_vocab())
    ids = tok(CHARS)["input_ids"]
    assert ids == list(range(2, 2 + len(CHARS)))
    assert tok.decode(ids) == CHARS


def test_task_strings_tokenize_per_character():
    tok = build_char_tokenizer()
    assert tok("12+34=")["input_ids"] == [3, 4, tok.convert_tokens_to_ids("+"), 5, 6, tok.convert_tokens_to_ids("=")]
    ids = tok("46<eos>")["input_ids"]
    assert ids == [6, 8, tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "46"


def test_ids_round_trip_through_auto_and_fast_loaders(tiny_dir):
    """AutoTokenizer on a qwen2 directory returns Qwen2Tokenizer (its own pipeline):
    it must agree with PreTrainedTokenizerFast and the in-memory tokenizer everywhere."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    fast = PreTrainedTokenizerFast.from_pretrained(str(tiny_dir), local_files_only=True)
    built = build_char_tokenizer()
    assert json.loads((tiny_dir / "config.json").read_text())["model_type"] == "qwen2"
    # From transformers 5.8 the trap is live (Qwen2Tokenizer), which makes the test meaningful; before,
    # AutoTokenizer gives the plain TokenizersBackend (setup.py admits 5.1, CI's second run tests it).
    from transformers import __version__ as tf_version
    live = tuple(int(x) for x in tf_version.split(".")[:2]) >= (5, 8)
    assert type(auto).__name__ == ("Qwen2Tokenizer" if live else "TokenizersBackend")
    texts = _addition_strings() + [CHARS, "user:what is 2*(3-1)\nassistant:", "a  b\n\nc", " x ", "<eos><pad>1"]
    assert not any(unsupported_chars(t.replace(EOS_TOKEN, "").replace(PAD_TOKEN, "")) for t in texts)
    ids_auto = auto(texts)["input_ids"]
    assert ids_auto == fast(texts)["input_ids"] == built(texts)["input_ids"]
    for text, ids in zip(texts, ids_auto):
        assert auto.decode(ids) == text
        assert len(ids) == len(text.replace(EOS_TOKEN, "#").replace(PAD_TOKEN, "#"))  # one id per character
    for t in (auto, fast):
        assert len(t) == len(built)  # no extra special token appended by Qwen2Tokenizer
        assert (t.pad_token_id, t.eos_token_id) == (0, 1)
        assert t.chat_template == built.chat_template


def test_chat_template_uses_only_vocab_characters():
    tok = build_char_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "system:add\nuser:1+2=\nassistant:"
    assert not unsupported_chars(text)
    assert tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize("text,bad", [("12+34=", set()), ("Hi!", {"H", "!"}), ("é", {"é"})])
def test_unsupported_chars(text, bad):
    assert unsupported_chars(text) == bad
