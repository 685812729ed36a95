"""Attention as the models' own eager code computes it, and SDPA where that computes the same: the arithmetic
the load probe, the prompts' path and the gather backend share, and what the kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.attention.layers import LayerCall, ScoreTerms


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    call: LayerCall,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """q [B, Hq, n, Dk], k [B, Hkv, m, Dk], v [B, Hkv, m, Dv], mask [B or 1, 1, n, m] bool (True: seen) ->
    [B, Hq, n, Dv], computed as the models' own eager attention does: scores, soft-capping, the queries' bias,
    mask, sinks as an extra column of the softmax (then dropped). SDPA does none of these but the mask."""
    gqa = q.shape[1] // k.shape[1]
    if gqa > 1:
        k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if terms is not None and terms.bias is not None:
        scores = scores + terms.bias
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = None
    if call.sinks is not None:
        sink = call.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    elif terms is not None and terms.sinks is not None:
        sink = terms.sinks.to(scores.dtype)
    if sink is not None:
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = scores.softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v)


def attend(q, k, v, mask, scale: float, call: LayerCall, causal: bool = False, terms=None) -> torch.Tensor:
    """SDPA where it computes the layer (`LayerCall.plain`; `causal`: its is_causal in place of the mask),
    else `eager_attention` (with the queries' terms) on `mask`, which is then always given: it is built with
    the step's metadata, never here per layer."""
    gqa = q.shape[1] > k.shape[1]
    if call.plain:
        if causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return eager_attention(q, k, v, mask, scale, call, terms)
