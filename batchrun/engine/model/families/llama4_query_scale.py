"""Llama 4's query scale (attention temperature tuning on its NoRoPE layers).

Why: those layers scale the queries by a function of the position, which transformers takes as the token's index
in the row: right for one sequence per row, wrong for batchrun's packed row of many. The attention multiplies
each layer's queries by `QueryScaleFix.factor`, the true scale over the applied one, per packed token.

Checks at load: modules with `attn_temperature_tuning` on and no RoPE (whatever the family calling them).
Provides: `query_scale_fixes` (architecture.check_config freezes them into each layer's LayerSpec; the step
metadata computes each distinct fix's factors once per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.model.families.adapter import FamilyAdapter


@dataclass(frozen=True)
class QueryScaleFix:
    """The scale log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 of position p: `factor` turns the one the
    layer applied at each packed index into the one of each token's true position."""

    floor_scale: float
    attn_scale: float

    def _scale(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def factor(self, positions: torch.Tensor) -> torch.Tensor:
        """[T]: true scale / applied scale of each packed token, from their positions [T]."""
        return self._scale(positions) / self._scale(torch.arange(len(positions), device=positions.device))


class Llama4QueryScale(FamilyAdapter):
    name = "Llama 4's query temperature"

    def query_scale_fixes(self, model) -> dict[int, QueryScaleFix]:
        fixes = {}
        for m in model.modules():
            if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
                fixes[m.layer_idx] = QueryScaleFix(float(m.floor_scale), float(m.attn_scale))
        return fixes


ADAPTER = Llama4QueryScale()
