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
) -> torch.Tensor:
    """query [T, Hq, D]; sequence s owns query rows query_start_loc[s]:query_start_loc[s+1], which are the last
    tokens of its seq_lens[s]-token context; a query at position p sees context positions <= p. fp32 math."""
    out = torch.empty_like(query)
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
        scores = scores.masked_fill(~(k_pos <= q_pos)[None], float("-inf"))
        out[starts[s] : starts[s + 1]] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v).to(query.dtype)
    return out
