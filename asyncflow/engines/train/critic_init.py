"""A critic (ValueModel) over a causal LM that may be on the meta device.

ValueModel puts its new value head where the backbone is, so over a meta backbone the head is
on meta too. This returns what loading needs besides: where each parameter is stored in the
causal LM's checkpoint (``backbone.*`` under the LM's own names; a reward model's ``score``
holds the head's weight) and real initial values for the head, which the first rank sends to
the others when the checkpoint does not hold it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from asyncflow.engines.train.meta_init import parameters_on_meta
from asyncflow.engines.train.value_model import ValueModel

__all__ = ["critic_model"]


def critic_model(causal_lm: nn.Module) -> tuple[ValueModel, dict[str, str], dict[str, Tensor]]:
    """(ValueModel(causal_lm), the checkpoint name of each of its tensors, initial head values)."""
    on_meta = any(p.device.type == "meta" for p in causal_lm.parameters())
    if not on_meta:
        return ValueModel(causal_lm), {}, {}
    with parameters_on_meta():
        model = ValueModel(causal_lm)
    stored: dict[int, str] = {}  # a tied tensor under its first name, the one checkpoints keep
    for name, tensor in [*causal_lm.named_parameters(remove_duplicate=False),
                         *causal_lm.named_buffers(remove_duplicate=False)]:
        stored.setdefault(id(tensor), name)
    source_names = {name: stored[id(t)] for name, t in [*model.backbone.named_parameters(prefix="backbone"),
                                                        *model.backbone.named_buffers(prefix="backbone")]
                    if id(t) in stored}
    head = nn.Linear(model.value_head.in_features, 1)  # the same init ValueModel gives a real head
    initial = {"value_head.weight": head.weight.detach(), "value_head.bias": head.bias.detach()}
    score = getattr(causal_lm, "score", None)
    if isinstance(score, nn.Linear) and score.out_features == 1:  # a reward model: its head scores
        source_names["value_head.weight"] = stored[id(score.weight)]
        initial["value_head.bias"] = torch.zeros(1)
        if score.bias is not None:
            source_names["value_head.bias"] = stored[id(score.bias)]
    return model, source_names, initial
