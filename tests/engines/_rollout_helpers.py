"""Shared by the rollout engine tests: a tiny random Qwen2 and random prompts."""
from __future__ import annotations

import torch

VOCAB, EOS, PAD = 64, 1, 0


def tiny_model(tie: bool = True, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM  # lazy: ~7 s, once per process
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      attn_implementation="eager", pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def ref_log_probs(model, prompt: torch.Tensor, response: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the response tokens from one full forward pass over prompt + response."""
    seq = torch.cat([prompt, response])[None]
    with torch.inference_mode():
        logits = model(seq).logits[0, prompt.numel() - 1: -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)
