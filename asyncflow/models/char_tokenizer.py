"""A character-level tokenizer: one token per character, ~50 ids.

Why character level: with a BPE tokenizer that merges digit pairs, a tiny model
barely learns 2-digit addition; one token per digit it does.

Why the odd pipeline: `AutoTokenizer.from_pretrained` on a directory whose
config.json says `model_type: qwen2` returns `Qwen2Tokenizer`, which rebuilds the
tokenizer from our vocab with its own normaliser (NFC), pre-tokenizer (Qwen2's
split regex, then byte-level) and byte-level decoder. We build ours with exactly
that pipeline and store every character in its byte-level spelling ('Ġ' for a
space, 'Ċ' for a newline; printable ASCII spells itself), so both
`AutoTokenizer` and `PreTrainedTokenizerFast.from_pretrained` give the same ids.

Characters outside the vocabulary are dropped by both loaders (Qwen2Tokenizer's
BPE has no unknown token): check text with `unsupported_chars` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

if TYPE_CHECKING:  # transformers is imported lazily: it costs seconds
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHARS",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "QWEN2_SPLIT_REGEX",
    "build_char_tokenizer",
    "char_vocab",
    "save_char_tokenizer",
    "unsupported_chars",
]

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
# Order fixes the ids: <pad>=0, <eos>=1, then these characters from id 2.
CHARS: str = (
    "0123456789"
    "+-*/=()"
    ".,:"
    "abcdefghijklmnopqrstuvwxyz"
    "#<>"
    " \n"
)
# Must equal transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (a test checks it).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# One "role:content" line per message; roles and separators are all in the vocab.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}:{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _byte_level_spelling() -> dict[str, str]:
    """Map each character of CHARS to the string ByteLevel turns it into."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spelling: dict[str, str] = {}
    for ch in CHARS:
        pieces = byte_level.pre_tokenize_str(ch)
        if len(pieces) != 1 or len(pieces[0][0]) != 1:  # multi-byte chars would need merges
            raise ValueError(f"character {ch!r} is not one byte-level symbol: {pieces}")
        spelling[ch] = pieces[0][0]
    return spelling


def char_vocab() -> dict[str, int]:
    """Token string -> id, in byte-level spelling (space is 'Ġ')."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for spelled in _byte_level_spelling().values():
        vocab[spelled] = len(vocab)
    return vocab


def unsupported_chars(text: str) -> set[str]:
    """Characters of `text` that the tokenizer would silently drop."""
    return set(text) - set(CHARS)


def _backend_tokenizer():
    """The `tokenizers.Tokenizer`, with the same pipeline Qwen2Tokenizer imposes."""
    # A BPE model with no merges is a fixed character vocabulary.
    tok = Tokenizer(BPE(vocab=char_vocab(), merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(PAD_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    return tok


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    # heavy: transformers, on first use
    """The character tokenizer as a transformers tokenizer, pad and eos set, with a chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend_tokenizer(),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        # Without an unk token named, Qwen2Tokenizer adds its default '<|endoftext|>' as
        # one more id, past the model's embedding. Our BPE never emits unk anyway.
        unk_token=EOS_TOKEN,
        padding_side="left",  # prompts are left-padded for generation
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_char_tokenizer(out_dir: str | Path) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save_pretrained(str(out))
    return out
