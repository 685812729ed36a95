"""The attention of a pooling job (embed): a step's texts packed into one row of tokens with no padding, each
text attending only to itself, inside the model's own `transformers` code.

A pooling job keeps no K/V after a text is pooled, so there are no pages here (the paged function is
attention.py's): `transformers` calls `packed_attention_forward` once per layer with q [1, Hq, T, D] and
k/v [1, Hkv, T, D] of the whole packed row, and the step's `PackedLayout` (where each text starts, built once
before the forward) arrives as the `batchrun_packed` keyword. Texts of similar length attend in one SDPA call,
gathered into a batch padded to the longest inside the attention alone (the padding's keys masked, its queries
dropped: the linear layers, most of the arithmetic, still see no padding); a text alone attends on its own
slice. Each text attends only to itself: bidirectional for an encoder
(BERT, XLM-R, ModernBERT), causal for a decoder (Qwen3-Embedding), as the layer's `is_causal` says; a sliding
window (ModernBERT's local layers) sees keys fewer than `sliding_window` positions away, on both sides for an
encoder (as transformers' masks have it). What a layer asks beyond that (soft-capping, sinks, dropout in
training) is an error (`UnsupportedModel`), never ignored: the runner's load probe meets it before any row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention import UnsupportedModel

PACKED_ATTENTION = "batchrun_packed"

# keywords transformers passes along that change nothing here (positions are the model's, already applied;
# `deterministic` is a flash-attention switch)
_IGNORED = {"position_ids", "deterministic", "output_attentions", "use_cache", "token_type_ids"}


# a group of texts attends in one SDPA call, padded to its longest inside the attention alone (the padding's keys
# masked, its queries dropped): up to this many times the attention arithmetic of the texts alone
GROUP_WASTE = 1.5


@dataclass
class LengthGroup:
    """Texts of similar length attending in one call: `index` [n * L] their token positions in the packed row,
    text after text (the shorter ones padded with their own last position), `valid` [n, L] which are real,
    `real` where the real ones are in `index` and `tokens` their positions in the row; None for a group of one
    text, which attends on its slice (`start`..`end`)."""

    start: int
    end: int
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    real: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)  # (causal, window) -> [n, 1, L, L] bool, made once per step

    def mask(self, causal: bool, window: int | None) -> torch.Tensor:
        key = (causal, window)
        if key not in self.masks:
            length = self.valid.shape[1]
            seen = _window_mask(length, window, causal, self.valid.device)
            if seen is None:
                seen = torch.ones(length, length, dtype=torch.bool, device=self.valid.device)
                if causal:
                    seen = seen.tril()
            self.masks[key] = (seen[None] & self.valid[:, None, :])[:, None]
        return self.masks[key]


@dataclass
class PackedLayout:
    """Where each text of a packed row starts and ends (starts[i]..starts[i + 1]) and how its texts are grouped
    for attention, built once per step before the forward; `calls`: the layers that attended through it (the
    load probe counts them)."""

    starts: tuple[int, ...]
    groups: list[LengthGroup]
    calls: int = 0

    @classmethod
    def of_lengths(cls, lengths: list[int], device: torch.device | None = None) -> PackedLayout:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return cls(tuple(starts), _groups(starts, lengths, device))

    def spans(self):
        return zip(self.starts[:-1], self.starts[1:])


def _groups(starts: list[int], lengths: list[int], device) -> list[LengthGroup]:
    """The texts, longest first, in groups whose padded attention costs at most GROUP_WASTE times theirs."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    members: list[list[int]] = []
    for i in order:
        group = members[-1] if members else None
        if group:
            longest = lengths[group[0]] ** 2
            real = sum(lengths[j] ** 2 for j in group) + lengths[i] ** 2
            if (len(group) + 1) * longest <= GROUP_WASTE * real:
                group.append(i)
                continue
        members.append([i])
    groups = []
    for group in members:
        if len(group) == 1:
            groups.append(LengthGroup(starts[group[0]], starts[group[0] + 1]))
            continue
        width = lengths[group[0]]
        rows = [[starts[i] + min(p, lengths[i] - 1) for p in range(width)] for i in group]
        index = torch.tensor(rows, device=device).flatten()
        valid = torch.tensor([[p < lengths[i] for p in range(width)] for i in group], device=device)
        real = valid.flatten().nonzero()[:, 0]
        groups.append(LengthGroup(0, 0, index, valid, real, index[real]))
    return groups


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
    out = query.new_empty(query.shape[1], query.shape[2], query.shape[3])  # [Hq, T, D]
    q, k, v = query[0], key[0], value[0]
    for g in layout.groups:
        if g.index is None:  # one text: its own slice
            a, b = g.start, g.end
            mask = _window_mask(b - a, sliding_window, causal, query.device)
            out[:, a:b] = F.scaled_dot_product_attention(
                q[:, a:b], k[:, a:b], v[:, a:b], attn_mask=mask, is_causal=causal and mask is None,
                scale=scaling, enable_gqa=gqa,
            )  # fmt: skip
            continue
        n, width = g.valid.shape
        # index_select, not advanced indexing: many times faster on the CPU (bench/micro/embed_ops.py)
        gathered = [
            x.index_select(1, g.index).view(x.shape[0], n, width, -1).transpose(0, 1) for x in (q, k, v)
        ]
        o = F.scaled_dot_product_attention(
            *gathered, attn_mask=g.mask(causal, sliding_window), scale=scaling, enable_gqa=gqa
        )  # [n, H, L, D]
        o = o.transpose(0, 1).reshape(o.shape[1], n * width, -1)
        out.index_copy_(1, g.tokens, o.index_select(1, g.real))
    return out.transpose(0, 1)[None], None


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
