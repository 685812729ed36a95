"""Triton kernels: the KV-cache write, and one paged attention kernel for prefill, chunked / prefix-cached
prefill and decode in the same launch.

Attention grid: (query blocks over all sequences, KV heads). A program takes BLOCK_Q query tokens of one
sequence and the GQA query heads that share one KV head, packed as BLOCK_M = BLOCK_Q * GQA rows, so each K/V
tile loaded from the pages serves every one of them. It walks the sequence's block table tile by tile (a tile
is BLOCK_N keys: one page, or several small pages), with an online softmax accumulated in fp32, and stops at
the last key its latest query may see (causal: a query at position p sees context positions <= p).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + page * stride_cp + offset * stride_cs + h * stride_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + page * stride_vcp + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] into k_cache/v_cache [num_pages, page_size, Hkv, D] at slot_mapping [T]
    (slot = page * page_size + offset; every token has a slot: batchrun packs no padding tokens)."""
    T, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, (k_cache.shape, v_cache.shape)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, key.shape)
    assert slot_mapping.shape == (T,), (slot_mapping.shape, T)
    assert (
        key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    )
    assert key.dtype == k_cache.dtype == value.dtype == v_cache.dtype
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],  # page, slot, head
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        PAGE_SIZE=k_cache.shape[1],
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_seq_ptr,
    block_index_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(block_seq_ptr + qb)
    q_block = tl.load(block_index_ptr + qb)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GQA  # query token within the sequence
    head = kv_head * GQA + rows % GQA  # query head
    row_ok = (q_tok < q_len) & (rows < BLOCK_Q * GQA)
    q_pos = ctx_len - q_len + q_tok  # absolute position of the query token
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + q_tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # keys this block can see: up to its last query's position
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (q_block + 1) * BLOCK_Q)
    n = tl.arange(0, BLOCK_N)
    for tile_start in range(0, kv_end, BLOCK_N):
        k_pos = tile_start + n
        in_ctx = k_pos < kv_end
        page = tl.load(block_tables_ptr + seq * stride_bt + k_pos // PAGE_SIZE, mask=in_ctx, other=0).to(
            tl.int64
        )
        slot = k_pos % PAGE_SIZE
        k = tl.load(
            k_cache_ptr
            + page[:, None] * stride_kp
            + slot[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :],
            mask=in_ctx[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :],
            mask=in_ctx[:, None],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr
        + (q_start + q_tok)[:, None].to(tl.int64) * stride_ot
        + head[:, None] * stride_oh
        + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@dataclass(frozen=True)
class QueryBlocks:
    """The attention grid's first axis, built on the host once per step: program i takes query block
    `index_of_block[i]` (of BLOCK_Q tokens) of sequence `seq_of_block[i]`."""

    seq_of_block: torch.Tensor  # [num programs] int32
    index_of_block: torch.Tensor  # [num programs] int32
    block_m: int  # rows of a program: BLOCK_Q query tokens x GQA heads
    block_q: int


def plan_query_blocks(query_lens: list[int], gqa: int, device: torch.device | str) -> QueryBlocks:
    """The grid mapping for sequences with `query_lens` query tokens each, from host integers (no device sync)."""
    # rows of a program: BLOCK_Q query tokens x GQA heads, at least 16 (tl.dot's minimum on NVIDIA GPUs)
    block_m = max(16, triton.next_power_of_2(gqa))
    if max(query_lens, default=1) * gqa > 16:
        block_m = max(block_m, 64)
    block_q = max(1, block_m // gqa)
    seq_of_block: list[int] = []
    index_of_block: list[int] = []
    for s, n in enumerate(query_lens):
        blocks = triton.cdiv(n, block_q)
        seq_of_block += [s] * blocks
        index_of_block += range(blocks)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    return QueryBlocks(as_tensor(seq_of_block), as_tensor(index_of_block), block_m, block_q)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_blocks: QueryBlocks | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's pages; returns [T, Hq, D].

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]: the last tokens of its seq_lens[s]-token
    context, whose K/V (new tokens included) are already in k_cache/v_cache [num_pages, page_size, Hkv, D] at the
    pages block_tables[s] lists in order. `query_blocks`: the grid mapping (plan_query_blocks), built once per
    step by the caller; without it the launcher builds it here, reading the query lengths back from the device.
    """
    T, num_heads, head_dim = query.shape
    num_pages, page_size, num_kv_heads, head_dim_k = k_cache.shape
    S = seq_lens.shape[0]
    assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
    assert head_dim_k == head_dim, (head_dim_k, head_dim)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query_start_loc.shape == (S + 1,), (query_start_loc.shape, S)
    assert block_tables.dim() == 2 and block_tables.shape[0] == S, (block_tables.shape, S)
    assert page_size & (page_size - 1) == 0 and 8 <= page_size <= 128, (
        f"page size {page_size}: 8..128, power of 2"
    )
    assert head_dim & (head_dim - 1) == 0 and 32 <= head_dim <= 256, (
        f"head dim {head_dim}: 32..256, power of 2"
    )
    assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), query.dtype
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    if T == 0:
        return out
    gqa = num_heads // num_kv_heads
    if query_blocks is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        query_blocks = plan_query_blocks(query_lens, gqa, query.device)
    block_n = max(page_size, 16)
    grid = (query_blocks.seq_of_block.numel(), num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        query_blocks.seq_of_block,
        query_blocks.index_of_block,
        scale,
        *query.stride()[:2],  # token, head
        *out.stride()[:2],
        *k_cache.stride()[:3],  # page, slot, head
        *v_cache.stride()[:3],
        block_tables.stride(0),
        GQA=gqa,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_Q=query_blocks.block_q,
        BLOCK_M=query_blocks.block_m,
        BLOCK_N=block_n,
        UPCAST=INTERPRETING or query.dtype == torch.float32,
        IEEE=query.dtype == torch.float32,
    )
    return out
