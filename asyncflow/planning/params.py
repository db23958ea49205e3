"""A dense decoder's shape, read from a Hugging Face ``config.json``, and its parameter count.

Read with ``json`` (no transformers import: it costs seconds). The count follows the
module layout of the architectures the engines support (models/loading.py): embeddings,
per layer q/k/v/o projections (grouped-query attention: k and v have ``num_key_value_heads``
heads), a gated MLP (gate, up, down), two RMSNorm weights, and the final norm and lm_head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "ParamCount", "PlanInputError", "count_params", "lora_params", "load_config_json",
           "tiny_model_config"]


class PlanInputError(ValueError):
    """An input of the planner (config.json, a flag) cannot be used; the message says which and why."""


@dataclass(frozen=True)
class AttentionBiases:
    """Which projections carry a bias, and whether q and k have their own RMSNorm (Qwen3)."""
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool = False


def _biases(model_type: str, cfg: dict[str, Any], source: str) -> AttentionBiases:
    attention_bias = bool(cfg.get("attention_bias", False))
    if model_type == "qwen2":  # Qwen2Attention: bias on q, k, v only
        return AttentionBiases(qkv_bias=True, o_bias=False, qk_norm=False)
    if model_type == "qwen3":  # Qwen3Attention: attention_bias on all four, plus q_norm / k_norm
        return AttentionBiases(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    if model_type == "llama":
        return AttentionBiases(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False,
                               mlp_bias=bool(cfg.get("mlp_bias", False)))
    if model_type == "mistral":
        return AttentionBiases(qkv_bias=False, o_bias=False, qk_norm=False)
    raise PlanInputError(f"{source}: model_type {model_type!r} is not a dense architecture the planner counts; "
                         "supported: qwen2, qwen3, llama, mistral (mixture-of-experts models are not supported)")


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    biases: AttentionBiases
    max_position_embeddings: int | None = None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelShape:
        """From a config.json's dict; ``source`` names it in errors."""
        if not isinstance(cfg, dict):
            raise PlanInputError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        if cfg.get("text_config") and "hidden_size" not in cfg:  # a multimodal wrapper: the LM's shape
            cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
        missing = [k for k in ("model_type", *_REQUIRED) if k not in cfg]
        if missing:
            raise PlanInputError(f"{source}: missing key(s) {missing}; a decoder config.json needs "
                                 f"model_type and {', '.join(_REQUIRED)}")
        values = {k: _positive_int(cfg, k, source) for k in _REQUIRED}
        heads = values["num_attention_heads"]
        kv_heads = _positive_int(cfg, "num_key_value_heads", source) if cfg.get("num_key_value_heads") else heads
        if heads % kv_heads:
            raise PlanInputError(f"{source}: num_attention_heads {heads} is not a multiple of "
                                 f"num_key_value_heads {kv_heads}")
        if cfg.get("head_dim"):
            head_dim = _positive_int(cfg, "head_dim", source)
        elif values["hidden_size"] % heads:
            raise PlanInputError(f"{source}: hidden_size {values['hidden_size']} is not divisible by "
                                 f"num_attention_heads {heads} and there is no head_dim key")
        else:
            head_dim = values["hidden_size"] // heads
        experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)]
        if experts:
            raise PlanInputError(f"{source}: {experts[0]}={cfg[experts[0]]}: mixture-of-experts models are not "
                                 "supported by the planner (dense decoders only)")
        model_type = str(cfg["model_type"])
        return cls(model_type=model_type, vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
                   intermediate_size=values["intermediate_size"], num_layers=values["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   # False when absent: the default of Qwen2Config, Qwen3Config, LlamaConfig, MistralConfig
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   biases=_biases(model_type, cfg, source),
                   max_position_embeddings=cfg.get("max_position_embeddings"))


def _positive_int(cfg: dict[str, Any], key: str, source: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanInputError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # the input embedding table
    per_layer: int  # one decoder layer: attention, MLP, its two norms
    num_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.num_layers + self.final_norm + self.lm_head

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matrix multiply per token (2 FLOPs each in a forward
        pass): all but the embedding lookup; a tied table is also the output projection."""
        return self.total - self.embedding + (self.embedding if self.lm_head == 0 else 0)

    @property
    def largest_unit(self) -> int:
        """The biggest block FSDP gathers at once: a layer, or the embedding / lm_head."""
        return max(self.per_layer, self.embedding, self.lm_head)


def lora_params(shape: ModelShape, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every linear layer of the decoder (the
    LM head aside: model.lora.target_modules=[all-linear]): rank * (in + out) per layer for
    q, k, v, o, gate, up and down."""
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * shape.num_layers


def count_params(shape: ModelShape) -> ParamCount:
    h, b = shape.hidden_size, shape.biases
    attention = (h * shape.q_dim + 2 * h * shape.kv_dim + shape.q_dim * h
                 + (shape.q_dim + 2 * shape.kv_dim if b.qkv_bias else 0) + (h if b.o_bias else 0)
                 + (2 * shape.head_dim if b.qk_norm else 0))
    mlp = 3 * h * shape.intermediate_size + ((2 * shape.intermediate_size + h) if b.mlp_bias else 0)
    embedding = shape.vocab_size * h
    return ParamCount(embedding=embedding, per_layer=attention + mlp + 2 * h, num_layers=shape.num_layers,
                      final_norm=h, lm_head=0 if shape.tie_word_embeddings else embedding)


def load_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """The dict of ``path`` (a config.json, or a model directory holding one) and the file's path."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanInputError(f"{p}: no such file; pass a model's config.json or the directory that holds it")
    try:
        return json.loads(p.read_text()), str(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanInputError(f"{p}: not valid JSON ({err})") from err


def tiny_model_config() -> dict[str, Any]:
    """The built-in tiny model's config (asyncflow.models.tiny), without building it."""
    # slow: asyncflow.models imports torch; `asyncflow plan` and `import asyncflow.cli` load none
    from asyncflow.models.char_tokenizer import char_vocab
    from asyncflow.models.tiny import TinyModelSpec

    spec = TinyModelSpec()
    return {"model_type": "qwen2", "vocab_size": len(char_vocab()), "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "max_position_embeddings": spec.max_position_embeddings}
