"""Plain PyTorch references for the paged kernels: slow, obvious, and what the kernels are tested against."""

from __future__ import annotations

import torch


def ref_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] -> k_cache/v_cache [num_pages, page_size, Hkv, D] at slots page * P + offset."""
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // page_size, slot % page_size] = key[t]
        v_cache[slot // page_size, slot % page_size] = value[t]


def ref_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, Hq, Dk]; sequence s owns query rows query_start_loc[s]:query_start_loc[s+1], which are the last
    tokens of its seq_lens[s]-token context; a query at position p sees context positions k <= p (and, with
    `window`, k > p - window; with `chunk`, k // chunk == p // chunk). `softcap`: scores -> softcap *
    tanh(scores / softcap); `sinks` [Hq] or [T, Hq]: one more logit per head (or per query token and head) in
    the softmax, dropped after it; `relative_bias` [T, Hq, R]: added to the score of the key d = p - k < R
    positions back; `alibi_slopes` [Hq]: -slope * (p - k) added to the score of the key at k. Returns
    [T, Hq, Dv]. fp32 math."""
    out = query.new_empty(*query.shape[:2], v_cache.shape[-1])
    page_size = k_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        q = query[starts[s] : starts[s + 1]].float()  # [n, Hq, D]
        n = q.shape[0]
        num_blocks = -(-ctx // page_size)
        pages = block_tables[s, :num_blocks].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, k_cache.shape[-1])[:ctx].float()  # [ctx, Hkv, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, v_cache.shape[-1])[:ctx].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # query head h uses KV head h // gqa
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q, k) * scale
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if relative_bias is not None:
            for i in range(n):  # query i at position ctx - n + i, key j at j
                for j in range(max(0, ctx - n + i - relative_bias.shape[2] + 1), ctx - n + i + 1):
                    scores[:, i, j] += relative_bias[starts[s] + i, :, ctx - n + i - j].float()
        if alibi_slopes is not None:
            scores = scores - alibi_slopes.float()[:, None, None] * (q_pos - k_pos).float()
        seen = k_pos <= q_pos
        if window:
            seen &= k_pos > q_pos - window
        if chunk:
            seen &= k_pos // chunk == q_pos // chunk
        scores = scores.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            if sinks.dim() == 2:  # per query token
                sink = sinks[starts[s] : starts[s + 1]].float().T[:, :, None]
            else:
                sink = sinks.float()[:, None, None].expand(-1, n, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hnc,chd->nhd", probs, v).to(query.dtype)
    return out
