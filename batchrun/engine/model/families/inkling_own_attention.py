"""Inkling 2's attention over the stack of its earlier blocks' outputs runs its model's own eager attention.

Why: that module calls transformers' attention interface over something other than the sequence's tokens (each
token attends over its own earlier blocks' outputs, on its own), so batchrun's paged attention has nothing to
page: the attention function hands such a module's calls to the eager attention of the module's own model file
(attention.interface reads `_batchrun_own_attention`). Without this adapter the module's call carries no step
metadata, which the load refuses.

Checks at load: modules of the class `Inkling2BlockAttentionResidual`; refuses the model where that module's
file has no `eager_attention_forward`. Provides: `adapt_modules`.
"""

from __future__ import annotations

import sys

from batchrun.engine.attention import refusal
from batchrun.engine.model.families.adapter import FamilyAdapter

OWN_ATTENTION = frozenset({"Inkling2BlockAttentionResidual"})


class InklingOwnAttention(FamilyAdapter):
    name = "Inkling 2's attention over earlier blocks"

    def adapt_modules(self, model) -> None:
        for m in model.modules():
            name = type(m).__name__
            if name not in OWN_ATTENTION:
                continue
            own = getattr(sys.modules[type(m).__module__], "eager_attention_forward", None)
            if own is None:
                raise refusal(model.config.model_type, f"{name}'s module has no eager attention of its own")
            m._batchrun_own_attention = own


ADAPTER = InklingOwnAttention()
