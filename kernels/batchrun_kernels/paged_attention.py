"""Triton kernels: the KV-cache write, and one paged attention kernel for prefill, chunked / prefix-cached
prefill and decode in the same launch.

Attention grid: (query blocks over all sequences, KV heads). A program takes BLOCK_Q query tokens of one
sequence and the GQA query heads that share one KV head, packed as BLOCK_M = BLOCK_Q * GQA rows, so each K/V
tile loaded from the pages serves every one of them. It walks the sequence's block table tile by tile (a tile
is BLOCK_N keys, within one page, or across two pages of 8), with an online softmax accumulated in fp32, and stops at
the last key its latest query may see (causal: a query at position p sees context positions <= p). A layer's
mask kind, soft-capping and sinks are run-time arguments: a sliding window (p - window < k) or a chunk
(k // chunk == p // chunk) also moves the first tile read, so pages wholly outside it are never loaded; sinks
(one per head, or per query token and head) start each row's online softmax at the sink logit (so it counts in
the denominator and in nothing else). A relative bias (Inkling 2's, per query token and head, by backward
distance p - k < R), added to each score the query sees, is a compile-time one (`REL_BIAS`).

Specializations: the dtype, the head dim, the rows of a program and whether a relative bias is added are
compile-time arguments; the GQA ratio, the tokens per program and the page size are run-time ones, so one
compiled kernel serves every model and page size of a head dim. `specializations()` lists every one the
launchers can produce, and `make kernels-check` (batchrun_kernels.check) compiles each for sm_80 and sm_90
ahead of time.
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
    page_shift,
    HEAD_DIM: tl.constexpr,
):
    # grid: (tokens, KV heads); one program copies one head's vector of one token
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot >> page_shift
    offset = slot & ((1 << page_shift) - 1)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d)
    tl.store(k_cache_ptr + page * stride_cp + offset * stride_cs + h * stride_ch + d, k)
    tl.store(v_cache_ptr + page * stride_vcp + offset * stride_vcs + h * stride_vch + d, v)


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
    check_supported(key.dtype, k_cache.shape[1], head_dim)
    if T == 0:
        return
    _write_kv_kernel[(T, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],  # page, slot, head
        *v_cache.stride()[:3],
        k_cache.shape[1].bit_length() - 1,  # log2 of the page size
        HEAD_DIM=head_dim,
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
    gqa,
    block_q,
    page_shift,
    window,
    chunk,
    softcap,
    sinks_ptr,
    has_sinks,
    stride_sink_t,
    rel_ptr,
    rel_extent,
    stride_rel_t,
    stride_rel_h,
    alibi_ptr,
    has_alibi,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    REL_BIAS: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(block_seq_ptr + qb)
    q_block = tl.load(block_index_ptr + qb)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * block_q + rows // gqa  # query token within the sequence
    head = kv_head * gqa + rows % gqa  # query head
    row_ok = (q_tok < q_len) & (rows < block_q * gqa)
    q_pos = ctx_len - q_len + q_tok  # absolute position of the query token
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + q_tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    q_row = (q_start + q_tok).to(tl.int64)  # the query token's packed row
    if has_sinks:  # the sink's logit as the running maximum, its e^0 = 1 in the denominator
        sink = tl.load(sinks_ptr + q_row * stride_sink_t + head, mask=row_ok, other=float("-inf"))
        m_i = sink.to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if has_alibi:  # each query head's ALiBi slope
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

    # keys this block can see: up to its last query's position, from its first query's first visible key
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (q_block + 1) * block_q)
    first_pos = ctx_len - q_len + q_block * block_q
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(first_pos - window + 1, 0)
    if chunk > 0:
        kv_start = first_pos - first_pos % chunk
    q_lo = tl.zeros_like(q_pos)  # each query's first visible key
    if window > 0:
        q_lo = q_pos - window + 1
    if chunk > 0:
        q_lo = q_pos - q_pos % chunk
    n = tl.arange(0, BLOCK_N)
    for tile_start in range((kv_start // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        k_pos = tile_start + n
        in_ctx = (k_pos < kv_end) & (k_pos >= kv_start)  # pages before kv_start may be given back: not read
        page = tl.load(block_tables_ptr + seq * stride_bt + (k_pos >> page_shift), mask=in_ctx, other=0).to(
            tl.int64
        )
        slot = k_pos & ((1 << page_shift) - 1)
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
        if softcap > 0:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (e^2x + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= q_lo[:, None])
        visible = visible & in_ctx[None, :] & row_ok[:, None]
        if REL_BIAS:  # the query's bias at the key's backward distance, within the extent
            back = q_pos[:, None] - k_pos[None, :]
            near = visible & (back < rel_extent)
            s += tl.load(
                rel_ptr + q_row[:, None] * stride_rel_t + head[:, None] * stride_rel_h + back,
                mask=near,
                other=0.0,
            ).to(tl.float32)
        if has_alibi:  # -slope * (query position - key position), as the reference adds it
            s += -slope[:, None] * (q_pos[:, None] - k_pos[None, :]).to(tl.float32)
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
    assert 1 <= gqa <= MAX_GQA, f"GQA ratio {gqa}: the kernels take 1..{MAX_GQA}"
    # rows of a program: BLOCK_Q query tokens x GQA heads; 16 (tl.dot's minimum on NVIDIA GPUs) for decode, 64
    # when a sequence brings several query tokens
    block_m = BLOCK_M_PREFILL if max(query_lens, default=1) * gqa > BLOCK_M_DECODE else BLOCK_M_DECODE
    block_q = max(1, block_m // gqa)
    seq_of_block: list[int] = []
    index_of_block: list[int] = []
    for s, n in enumerate(query_lens):
        blocks = triton.cdiv(n, block_q)
        seq_of_block += [s] * blocks
        index_of_block += range(blocks)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    return QueryBlocks(as_tensor(seq_of_block), as_tensor(index_of_block), block_m, block_q)


# ---- what the engine can launch: one list, read by the launchers and by `make kernels-check` ------------------
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PAGE_SIZES = (8, 16, 32, 64, 128)
HEAD_DIMS = (32, 64, 128, 256)
MAX_GQA = 16  # query heads per KV head; a run-time argument, like the page size
BLOCK_M_DECODE, BLOCK_M_PREFILL = 16, 64  # query rows of a program (BLOCK_Q tokens x GQA heads)
BLOCK_N = 16  # keys of a tile (a tile never spans two pages: every page size is a multiple of it, but 8's)


def check_supported(dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    """AssertionError unless the kernels are built (and `make kernels-check`ed) for this shape."""
    assert dtype in DTYPES, f"dtype {dtype}: the kernels take {DTYPES}"
    assert page_size in PAGE_SIZES, f"page size {page_size}: the kernels take {PAGE_SIZES}"
    assert head_dim in HEAD_DIMS, f"head dim {head_dim}: the kernels take {HEAD_DIMS}"


def unsupported_reason(dtype: torch.dtype, page_size: int, head_dim: int, v_head_dim: int, gqa: int) -> str:
    """Why the kernels cannot run a model of this shape ('' when they can): asked once, at load."""
    if v_head_dim != head_dim:
        return f"keys of head dim {head_dim} and values of {v_head_dim} (MLA); the kernels take one head dim"
    try:
        check_supported(dtype, page_size, head_dim)
    except AssertionError as e:
        return str(e)
    if not 1 <= gqa <= MAX_GQA:
        return f"{gqa} query heads per KV head; the kernels take 1..{MAX_GQA}"
    return ""


def attention_constexprs(dtype: torch.dtype, head_dim: int, block_m: int, rel_bias: bool = False) -> dict:
    """The compile-time arguments of `_paged_attention_kernel` for one launch. A relative bias is one (a kernel
    of its own): as a run-time branch, its loads in the inner loop cost every other model registers
    (`make kernels-check`, bench/RESULTS.md)."""
    fp32 = dtype == torch.float32
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        UPCAST=INTERPRETING or fp32,
        IEEE=fp32,
        REL_BIAS=rel_bias,
    )


def launch_options(block_m: int) -> dict:
    """Warps of a program: 8 for the 64-row prefill programs (at 4, a head dim of 128 spilled registers on
    sm_80 and sm_90: `make kernels-check`), 4 for the 16-row decode ones."""
    return {"num_warps": 8 if block_m >= BLOCK_M_PREFILL else 4}


def specializations():
    """Every (kernel, dtype, compile-time arguments, launch options) the launchers can produce."""
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            yield _write_kv_kernel, dtype, dict(HEAD_DIM=head_dim), {"num_warps": 4}
            for block_m in (BLOCK_M_DECODE, BLOCK_M_PREFILL):
                for rel_bias in (False, True):
                    yield (
                        _paged_attention_kernel,
                        dtype,
                        attention_constexprs(dtype, head_dim, block_m, rel_bias),
                        launch_options(block_m),
                    )


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
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's pages; returns [T, Hq, D].

    `window` > 0: a query at p sees keys p - window < k <= p; `chunk` > 0: keys of its own chunk; `softcap` > 0:
    scores capped as softcap * tanh(s / softcap); `sinks` [Hq] or [T, Hq]: one more logit per head (or per query
    token and head) in the softmax; `relative_bias` [T, Hq, R]: added (after soft-capping) to the score of the
    key d = p - k < R positions back; `alibi_slopes` [Hq]: ALiBi, -slope * (p - k) added to the score of the key
    at k (after the relative bias).

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
    assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
    check_supported(query.dtype, page_size, head_dim)
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    if T == 0:
        return out
    assert not (window and chunk), "a sliding window or chunks, not both"
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        assert sinks.shape in ((num_heads,), (T, num_heads)), (sinks.shape, num_heads)
        if sinks.dim() == 1:
            sinks = sinks.expand(T, num_heads)  # token stride 0
    if relative_bias is not None:
        relative_bias = relative_bias.detach().to(torch.float32).contiguous()
        assert relative_bias.dim() == 3 and relative_bias.shape[:2] == (T, num_heads), relative_bias.shape
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().to(torch.float32).contiguous()
        assert alibi_slopes.shape == (num_heads,), (alibi_slopes.shape, num_heads)
    gqa = num_heads // num_kv_heads
    if query_blocks is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        query_blocks = plan_query_blocks(query_lens, gqa, query.device)
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
        gqa,
        query_blocks.block_q,
        page_size.bit_length() - 1,  # log2 of the page size
        window,
        chunk,
        float(softcap),
        sinks if sinks is not None else seq_lens,  # any valid pointer when there are none
        int(sinks is not None),
        sinks.stride(0) if sinks is not None else 0,
        relative_bias if relative_bias is not None else seq_lens,
        relative_bias.shape[2] if relative_bias is not None else 0,
        *(relative_bias.stride()[:2] if relative_bias is not None else (0, 0)),
        alibi_slopes if alibi_slopes is not None else seq_lens,
        int(alibi_slopes is not None),
        **attention_constexprs(query.dtype, head_dim, query_blocks.block_m, relative_bias is not None),
        **launch_options(query_blocks.block_m),
    )
    return out
