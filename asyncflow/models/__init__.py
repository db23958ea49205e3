"""Models and tokenizers: the tiny built-in model, and loading local checkpoints.

Nothing here imports transformers at module level (it is slow to import, and code that only
names a model must not pay for it); the functions import it when called.
"""

from asyncflow.models.char_tokenizer import (
    CHARS,
    EOS_TOKEN,
    PAD_TOKEN,
    build_char_tokenizer,
    save_char_tokenizer,
    unsupported_chars,
)
from asyncflow.models.loading import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    check_tokenizer_fits,
    load_causal_lm,
    load_tokenizer,
)
from asyncflow.models.tiny import TinyModelSpec, build_tiny_model, default_cache_root, ensure_tiny_model

__all__ = [
    "CHARS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SUPPORTED_ARCHITECTURES",
    "ModelLoadError",
    "TinyModelSpec",
    "build_char_tokenizer",
    "build_tiny_model",
    "check_tokenizer_fits",
    "default_cache_root",
    "ensure_tiny_model",
    "load_causal_lm",
    "load_tokenizer",
    "save_char_tokenizer",
    "unsupported_chars",
]
