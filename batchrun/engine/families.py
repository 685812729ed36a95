"""Family rules: what particular model families compute around their attention that batchrun must adapt to,
one rule each, in one place. Each says which modules or config keys it recognises (checked at load, by the
probe in architecture.py) and what it overrides; a family none of them covers runs on transformers' code as it
is, or is refused at load with the reason (architecture.py), never computed by another family's rule.

- Llama 4 (`QueryScaleFix`): its NoRoPE layers scale queries by a function of the position, taken from the
  packed row's index; the attention turns it into each token's true position's.
- RecurrentGemma (`ATTRIBUTE_STATES`): its recurrent block keeps its states in attributes of its own; they are
  moved in and out of the sequence's state slot around each call (state_cache.AttributeStates).
- Inkling 2 (`RELATIVE_BIAS`, `OWN_ATTENTION`): its relative position bias module is asked for the bias at every
  backward distance, which the attention places by true positions; its attention over the stack of earlier
  blocks' outputs runs its model's own eager attention.

Rules that live with the mechanism they configure: Qwen-VL's 3-D positions and Gemma's image blocks
(multimodal.MRope, multimodal.ImageBlocks), KV-shared layers and MLA's K/V shapes (kv_cache), the processors
built without torchvision (loading).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import RelativeBias, refusal


@dataclass(frozen=True)
class QueryScaleFix:
    """Llama 4's attention temperature tuning (its NoRoPE layers) scales the queries by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 of the position p, but takes p as the token's index in
    the row: right for one sequence per row, wrong for batchrun's packed row. `factor` turns the scale it applied
    into the one of each token's true position."""

    floor_scale: float
    attn_scale: float

    def _scale(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def factor(self, positions: torch.Tensor) -> torch.Tensor:
        """[T]: true scale / applied scale of each packed token, from their positions [T]."""
        return self._scale(positions) / self._scale(torch.arange(len(positions), device=positions.device))


def query_scale_fixes(model) -> dict[int, QueryScaleFix]:
    """Layer -> its QueryScaleFix: modules with Llama 4's attention temperature tuning and no RoPE."""
    fixes = {}
    for m in model.modules():
        if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
            fixes[m.layer_idx] = QueryScaleFix(float(m.floor_scale), float(m.attn_scale))
    return fixes


# Stateful modules that keep their states in attributes of their own, not in transformers' cache interface: the
# attributes (dotted paths from the module) of their convolution and recurrent states, which batchrun moves in
# and out of the module around each call (state_cache.AttributeStates)
ATTRIBUTE_STATES = {"RecurrentGemmaRecurrentBlock": ("conv1d_state", "rg_lru.recurrent_states")}


# Relative position bias modules (class -> the attribute holding their extent R): the attention calls them with
# distances over the packed row's indices, which are not the tokens' positions; batchrun asks the module's own
# forward for the bias at every backward distance 0..R-1 instead, and the attention puts each at its key
# (attention.RelativeBias, TokenScores)
RELATIVE_BIAS = {"Inkling2RelativePositionBias": "rel_extent"}
# Modules that call the attention interface over something other than the sequence's tokens (Inkling 2's
# attention over the stack of earlier blocks' outputs, each token on its own): their model's own eager attention
OWN_ATTENTION = frozenset({"Inkling2BlockAttentionResidual"})


def adapt_modules(model) -> None:
    """Install the RELATIVE_BIAS and OWN_ATTENTION adapters on this model's instances (idempotent)."""
    import sys

    for m in model.modules():
        name = type(m).__name__
        if name in RELATIVE_BIAS and "_batchrun_bias_forward" not in m.__dict__:
            m._batchrun_bias_forward = m.forward
            m.forward = _relative_bias_forward.__get__(m)
        elif name in OWN_ATTENTION:
            own = getattr(sys.modules[type(m).__module__], "eager_attention_forward", None)
            if own is None:
                raise refusal(model.config.model_type, f"{name}'s module has no eager attention of its own")
            m._batchrun_own_attention = own


def _relative_bias_forward(
    self, hidden_states: torch.Tensor, relative_distance, *args, **kwargs
) -> RelativeBias:
    """The bias module's own forward, asked for each of its R backward distances at every token: [1, Hq, T, R]."""
    T, extent = hidden_states.shape[1], getattr(self, RELATIVE_BIAS[type(self).__name__])
    every = torch.arange(extent, device=hidden_states.device).expand(T, extent)
    return RelativeBias(self._batchrun_bias_forward(hidden_states, every, *args, **kwargs))
