"""A tiny Qwen2 model with the character tokenizer, built offline and cached.

The shape: hidden 128, 2 layers, 4 heads,
FFN 512, tied embeddings (~0.5M parameters) learns `a+b=` on a laptop CPU; eager
attention is faster than SDPA at these shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncflow.models.char_tokenizer import CHARS, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, char_vocab, save_char_tokenizer

__all__ = ["SPEC_FILE", "TinyModelSpec", "build_tiny_model", "default_cache_root", "ensure_tiny_model"]

# Written last into a built directory: its presence means the build is complete,
# and loading.py reads attn_implementation from it (an export writes only that key).
SPEC_FILE = "asyncflow_spec.json"
# Bump when the files a build writes change, so old caches are not reused.
_BUILD_VERSION = 1


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; vocab size always equals the character tokenizer's."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = True
    attn_implementation: str = "eager"
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TinyModelSpec: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; pick heads that divide it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyModelSpec: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"TinyModelSpec: attn_implementation {self.attn_implementation!r}; expected 'eager' or 'sdpa'"
            )

    def digest(self) -> str:
        """Short hash of everything that shapes the built files (spec, vocab, template)."""
        payload = json.dumps(
            {
                "spec": dataclasses.asdict(self),
                "vocab": CHARS,
                "template": CHAT_TEMPLATE,
                "build": _BUILD_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _qwen2_config(spec: TinyModelSpec, vocab_size: int, pad_id: int, eos_id: int):
    from transformers import Qwen2Config  # heavy: transformers, on first use

    return Qwen2Config(  # type: ignore[call-arg]  # rope_theta, attn_implementation: **kwargs it does not annotate
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        rope_theta=spec.rope_theta,
        bos_token_id=eos_id,  # as in Qwen: no separate BOS, prompts start bare
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attn_implementation=spec.attn_implementation,
        architectures=["Qwen2ForCausalLM"],
    )


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a Hugging Face model directory (config, safetensors weights, tokenizer,
    generation config) into out_dir, which must not hold a model already."""
    # heavy: transformers, on first use
    from transformers import GenerationConfig, Qwen2ForCausalLM


    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    if (out / "config.json").exists():
        raise FileExistsError(f"build_tiny_model: {out} already holds a model (config.json); pick an empty directory")
    out.mkdir(parents=True, exist_ok=True)

    vocab = char_vocab()
    pad_id, eos_id = vocab[PAD_TOKEN], vocab[EOS_TOKEN]
    config = _qwen2_config(spec, len(vocab), pad_id, eos_id)
    # A private RNG stream: the same seed gives the same weights, and the caller's
    # global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
    model.save_pretrained(str(out))
    save_char_tokenizer(out)
    (out / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True))
    return out


def default_cache_root() -> Path:
    """$ASYNCFLOW_CACHE, else ~/.cache/asyncflow."""
    env = os.environ.get("ASYNCFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "asyncflow"


def ensure_tiny_model(cache_dir: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Path of the tiny model built for `spec`, building it on first use.

    It lives in `<cache root>/models/<spec digest>`, the cache root being cache_dir,
    else $ASYNCFLOW_CACHE, else ~/.cache/asyncflow. A build goes into a temporary
    directory beside it and is renamed into place, so a reader never sees half a
    model; when processes race, one rename wins and the others drop their copy.
    A process killed mid-build leaves a `.<digest>.tmp-*` directory beside it,
    which is never read and can be deleted.
    """
    spec = spec or TinyModelSpec()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / "models" / spec.digest()
    if (final / SPEC_FILE).is_file():
        return final
    if final.exists():
        raise RuntimeError(
            f"ensure_tiny_model: {final} exists but has no {SPEC_FILE}, so it is not a complete build "
            f"(not made by ensure_tiny_model, or edited). Delete that directory and call again."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build_tiny_model(tmp, spec)
        try:
            os.rename(tmp, final)  # atomic; fails if another process renamed first
        except OSError as exc:
            if not (final / SPEC_FILE).is_file():
                raise RuntimeError(f"ensure_tiny_model: could not move the build {tmp} to {final}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
