"""The attention of a pooling job (embed): a step's texts packed into one row of tokens with no padding, each
text attending only to itself, inside the model's own `transformers` code.

A pooling job keeps no K/V after a text is pooled, so there are no pages here (the paged function is
attention.py's): `transformers` calls `packed_attention_forward` once per layer with q [1, Hq, T, D] and
k/v [1, Hkv, T, D] of the whole packed row, and the step's `PackedLayout` (where each text starts) arrives as
the `batchrun_packed` keyword. Each text runs through SDPA on its own slice: bidirectional for an encoder
(BERT, XLM-R, ModernBERT), causal for a decoder (Qwen3-Embedding), as the layer's `is_causal` says; a sliding
window (ModernBERT's local layers) sees keys fewer than `sliding_window` positions away, on both sides for an
encoder (as transformers' masks have it). What a layer asks beyond that (soft-capping, sinks, dropout in
training) is an error (`UnsupportedModel`), never ignored: the runner's load probe meets it before any row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import UnsupportedModel

PACKED_ATTENTION = "batchrun_packed"

# keywords transformers passes along that change nothing here (positions are the model's, already applied;
# `deterministic` is a flash-attention switch)
_IGNORED = {"position_ids", "deterministic", "output_attentions", "use_cache", "token_type_ids"}


@dataclass
class PackedLayout:
    """Where each text of a packed row starts and ends: starts[i]..starts[i + 1]; `calls`: the layers that
    attended through it (the load probe counts them)."""

    starts: tuple[int, ...]
    calls: int = 0

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> PackedLayout:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return cls(tuple(starts))

    def spans(self):
        return zip(self.starts[:-1], self.starts[1:])


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One layer's attention over the packed row; returns [1, T, Hq, D] (the layout transformers expects)."""
    layout: PackedLayout | None = kwargs.pop("batchrun_packed", None)
    if layout is None:
        raise UnsupportedModel("its layers do not pass the step's layout on to their attention function")
    if attention_mask is not None:
        raise UnsupportedModel("it builds an attention mask of its own for batchrun's packed attention")
    if dropout and module.training:
        raise UnsupportedModel("attention dropout in training mode")
    unknown = {k for k, v in kwargs.items() if v is not None and v is not False and k not in _IGNORED}
    unknown -= {
        k for k in kwargs if k.startswith(("cu_seq_lens", "max_length"))
    }  # flash-attention varlen hints
    if unknown:
        raise UnsupportedModel(
            f"its attention takes {', '.join(sorted(unknown))}, which batchrun does not compute"
        )
    layout.calls += 1
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query.transpose(1, 2))  # [1, T, Hq, D]
    for start, end in layout.spans():
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        mask = _window_mask(end - start, sliding_window, causal, query.device)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scaling, enable_gqa=gqa
        )
        out[:, start:end] = o.transpose(1, 2)
    return out, None


def _window_mask(n: int, window: int | None, causal: bool, device) -> torch.Tensor | None:
    """[n, n] bool: the keys a query sees within `window` (distance < window; causal: earlier keys only), or None
    for no window."""
    if window is None or window >= n:
        return None
    pos = torch.arange(n, device=device)
    distance = pos[:, None] - pos[None, :]
    seen = distance.abs() < window
    return seen & (distance >= 0) if causal else seen


def register() -> None:
    """Make `attn_implementation="batchrun_packed"` known to transformers (idempotent, no global patching)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
