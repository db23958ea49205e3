"""Model configs for the planner tests: Qwen2.5-7B and 32B as their config.json files give them,
and a small hand-made one whose bytes are worked out by hand in the tests."""
from __future__ import annotations

from asyncflow.planning import ModelShape, count_params

QWEN25_7B = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
             "tie_word_embeddings": False}
QWEN25_32B = {"model_type": "qwen2", "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 27648,
              "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
              "tie_word_embeddings": False}
# head_dim 4, one KV head shared by the two query heads (GQA)
SMALL = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100, "tie_word_embeddings": False}
# SMALL's count, by hand: embedding 100*8 = 800; per layer q 8*8+8 = 72, k 8*4+4 = 36, v 36, o 8*8 = 64,
# MLP 3*8*16 = 384, two norms 16 -> 608; final norm 8; lm_head 800 -> 800 + 2*608 + 8 + 800
SMALL_PARAMS = 2824


def small():
    shape = ModelShape.from_config(SMALL)
    return shape, count_params(shape)
