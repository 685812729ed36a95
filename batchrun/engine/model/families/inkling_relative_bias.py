"""Inkling 2's relative position bias, asked of its own module at every backward distance.

Why: the model's bias module is called with distances over the packed row's indices, which are not the tokens'
positions once several sequences share the row. batchrun asks the module's own forward for the bias at every
backward distance 0..R-1 instead (`attention.RelativeBias`), and the attention puts each at its key by true
positions (attention.TokenScores). Without this adapter the module's bias over the row reaches the attention
as a plain tensor, which the attention refuses at load.

Checks at load: modules of the class `Inkling2RelativePositionBias` (their extent R in `rel_extent`).
Provides: `adapt_modules` (the module's forward, wrapped).
"""

from __future__ import annotations

import torch

from batchrun.engine.attention import RelativeBias
from batchrun.engine.model.families.adapter import FamilyAdapter

# bias module class -> the attribute holding its extent R
RELATIVE_BIAS = {"Inkling2RelativePositionBias": "rel_extent"}


class InklingRelativeBias(FamilyAdapter):
    name = "Inkling 2's relative position bias"

    def adapt_modules(self, model) -> None:
        for m in model.modules():
            if type(m).__name__ in RELATIVE_BIAS and "_batchrun_bias_forward" not in m.__dict__:
                extent = getattr(m, RELATIVE_BIAS[type(m).__name__])
                # every distance 0..R-1, made once here on the module's device (a buffer: it moves with the
                # module), not per layer in the forward
                device = next(m.parameters()).device
                m.register_buffer(
                    "_batchrun_distances", torch.arange(extent, device=device), persistent=False
                )
                m._batchrun_bias_forward = m.forward
                m.forward = _relative_bias_forward.__get__(m)


def _relative_bias_forward(
    self, hidden_states: torch.Tensor, relative_distance, *args, **kwargs
) -> RelativeBias:
    """The bias module's own forward, asked for each of its R backward distances at every token: [1, Hq, T, R]."""
    every = self._batchrun_distances.expand(hidden_states.shape[1], -1)
    return RelativeBias(self._batchrun_bias_forward(hidden_states, every, *args, **kwargs))


ADAPTER = InklingRelativeBias()
