"""Critic model: a causal LM's transformer backbone plus a linear value head.

The LM head is dropped (a critic never needs vocabulary logits); the value of each
position is `value_head(last_hidden_state)`, computed in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    """`ValueModel(causal_lm)(input_ids, attention_mask, position_ids) -> values [b, T]`."""

    def __init__(self, backbone_causal_lm: nn.Module) -> None:
        super().__init__()
        get_decoder = getattr(backbone_causal_lm, "get_decoder", None)
        backbone = get_decoder() if callable(get_decoder) else getattr(backbone_causal_lm, "model", None)
        if backbone is None:
            raise TypeError(
                f"ValueModel needs a HF causal LM with a decoder (get_decoder() or .model); "
                f"got {type(backbone_causal_lm).__name__}"
            )
        config = getattr(backbone_causal_lm, "config", None)
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int):
            raise TypeError(f"{type(backbone_causal_lm).__name__}.config has no integer hidden_size")
        self.config = config
        self.backbone = backbone
        self.value_head = nn.Linear(hidden, 1)
        score = getattr(backbone_causal_lm, "score", None)
        if isinstance(score, nn.Linear) and score.out_features == 1:
            # A sequence-classification checkpoint (a reward model): its head scores a position.
            with torch.no_grad():
                self.value_head.weight.copy_(score.weight)
                self.value_head.bias.copy_(score.bias if score.bias is not None else torch.zeros(1))
        param = next(backbone.parameters())
        self.value_head.to(device=param.device, dtype=param.dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.value_head(hidden).squeeze(-1).float()
