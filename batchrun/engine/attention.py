"""batchrun's attention inside stock `transformers` models.

The model runs on one packed row of every token scheduled this step. `transformers` calls the function
registered here once per layer, with q [1, Hq, T, D] and k/v [1, Hkv, T, D] after RoPE; the step's
`AttentionMetadata` arrives as the `batchrun_attn` keyword. The function writes the new K/V into their page
slots (slot mapping) and attends through the block tables, with one of three backends, each an object chosen
once per engine (`make_backend`):
- `TorchAttention` (`torch`, the CPU default): decoding sequences through batchrun's C++ extension, which reads
  K/V in the pages (`cpu_kernels.cpp`), prompts through SDPA;
- `GatherAttention` (`gather`): plain PyTorch, gathering each group's pages into a padded batch for SDPA (what
  `torch` falls back to where the C++ kernel cannot be built, or on a GPU, and what the kernel was measured
  against: bench/attention_cpu.py);
- `TritonAttention` (the GPU default): the paged kernels in `batchrun_kernels`, which read K/V in the pages.
A backend builds its metadata once per step, before the forward (`prepare`, from host integers: nothing in
the forward waits on the device to learn a shape), and every layer runs from it (`forward`).
"""

from __future__ import annotations

import array
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .block_manager import cdiv

ATTENTION_NAME = "batchrun_paged"
_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.long, device: torch.device | None = None):
    """A 1-D integer tensor of Python ints, through an `array.array`'s buffer: 3x faster than `torch.tensor`,
    which converts one element at a time (15 vs 5 us for 256 ints: bench/host_ops.py), and a step builds
    several from lists."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array.array(_ARRAY_TYPECODES[dtype], values), dtype=dtype)
    return t if device is None or device.type == "cpu" else t.to(device)


def padded_int_tensor(rows: list[list[int]], width: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[len(rows), width]: each row padded with 0 (block tables)."""
    flat: list[int] = []
    zeros = [0] * width
    for r in rows:
        flat += r
        flat += zeros[len(r) :]
    return int_tensor(flat, dtype, device).view(len(rows), width)


@dataclass
class StepLayout:
    """What every backend builds its metadata from: one entry per scheduled sequence, in packed order."""

    query_lens: list[int]  # tokens computed for it this step
    context_lens: list[int]  # its context after this step (new tokens included)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] int64: cache slot (page * page_size + offset) of each new token


@dataclass
class DecodeBatch:
    """The step's decoding sequences (one query token each), attended together over their gathered pages."""

    token_index: torch.Tensor  # [G] packed-token index of each sequence's query
    page_index: torch.Tensor  # [G * num_blocks] block tables, flattened (padded with page 0)
    mask: torch.Tensor  # [G, 1, 1, num_blocks * page_size] bool: key j is in the sequence's context
    num_blocks: int


@dataclass
class PrefillSequence:
    """One sequence computing several tokens: a prompt, a chunk of one, or a prompt behind cached pages."""

    start: int  # first packed-token index of its queries
    num_tokens: int
    context_len: int  # tokens it attends to, its new ones included
    pages: torch.Tensor | None  # [num_blocks] its block table, when earlier tokens live in the cache
    mask: torch.Tensor | None  # [1, 1, num_tokens, num_blocks * page_size], causal at the right offset


class Workspace:
    """Buffers reused by every layer and step: fresh large tensors each call cost page faults on the CPU."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer; `backend` runs them."""

    times: Any  # timing.PhaseTimes: the layers add their seconds to "attention"
    backend: Any  # TorchAttention | GatherAttention | TritonAttention
    kv_cache: Any  # KVCache
    slot_mapping: torch.Tensor  # [T] int64
    max_seq_len: int
    plan: Any  # the backend's own per-step data: GatherPlan | TritonPlan


@dataclass
class GatherPlan:
    decode: list[DecodeBatch]
    prefills: list[PrefillSequence]


def split_step(layout: StepLayout, page_size: int, device: torch.device):
    """The decoding sequences as (packed row of the query, index), and a PrefillSequence for every other one:
    each is attended on its own, so a long prompt pads nothing else."""
    decode_rows, prefills = [], []
    start = 0
    for i, (q, c) in enumerate(zip(layout.query_lens, layout.context_lens)):
        if q == 1:
            decode_rows.append((start, i))
        else:
            pages = mask = None
            if c > q:  # earlier tokens are in the cache: read them through the block table
                num_blocks = cdiv(c, page_size)
                pages = torch.tensor(layout.block_tables[i][:num_blocks], device=device)
                key_pos = torch.arange(num_blocks * page_size, device=device)
                query_pos = torch.arange(c - q, c, device=device)
                mask = (key_pos[None, :] <= query_pos[:, None])[None, None]
            prefills.append(PrefillSequence(start, q, c, pages, mask))
        start += q
    return decode_rows, prefills


def _buckets_by_length(
    rows: list[tuple[int, int]], context_lens: list[int], page_size: int, slack: float = 0.8
) -> list[list[tuple[int, int]]]:
    """Split decoding rows into groups of similar context length: each group is padded to its longest context,
    and one padded group of very different lengths reads (and attends over) up to several times the K/V."""
    ordered = sorted(rows, key=lambda r: context_lens[r[1]], reverse=True)
    buckets: list[list[tuple[int, int]]] = []
    for r in ordered:
        blocks = cdiv(context_lens[r[1]], page_size)
        if buckets and blocks >= slack * cdiv(context_lens[buckets[-1][0][1]], page_size):
            buckets[-1].append(r)
        elif buckets and len(buckets) >= 6:
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def _decode_batch(
    rows: list[tuple[int, int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    device: torch.device,
) -> DecodeBatch:
    num_blocks = max(cdiv(context_lens[i], page_size) for _, i in rows)
    tables = [block_tables[i][:num_blocks] for _, i in rows]
    ctx = int_tensor([context_lens[i] for _, i in rows], device=device)
    key_pos = torch.arange(num_blocks * page_size, device=device)
    return DecodeBatch(
        token_index=int_tensor([t for t, _ in rows], device=device),
        page_index=padded_int_tensor(tables, num_blocks, torch.long, device).view(-1),
        mask=(key_pos[None, :] < ctx[:, None])[:, None, None, :],
        num_blocks=num_blocks,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] into the pages [num_pages, P, Hkv, D] at slot_mapping [T]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if key.shape[0] > 64:  # a prompt's K/V arrive head-major; index_copy_ is 2x faster from a contiguous copy
        key, value = key.contiguous(), value.contiguous()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gathered_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode: list[DecodeBatch],
    scale: float,
    workspace: Workspace,
) -> None:
    """Decoding rows of query [T, Hq, D] into out: each group's pages gathered into the workspace, then SDPA."""
    num_heads, head_dim = query.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1:3]
    gqa = num_heads // num_kv_heads
    for batch in decode:
        G = batch.token_index.shape[0]
        ctx = batch.num_blocks * page_size
        # GQA: the query heads of one KV head become the query rows of that head
        q = query[batch.token_index].view(G, num_kv_heads, gqa, head_dim)
        k = workspace.get("k", (G * batch.num_blocks, page_size, num_kv_heads, head_dim), k_cache)
        v = workspace.get("v", (G * batch.num_blocks, page_size, num_kv_heads, head_dim), v_cache)
        torch.index_select(k_cache, 0, batch.page_index, out=k)
        torch.index_select(v_cache, 0, batch.page_index, out=v)
        k = k.view(G, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(G, ctx, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)  # [G, Hkv, gqa, D]
        out[batch.token_index] = o.reshape(G, num_heads, head_dim)


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSequence],
    scale: float,
) -> None:
    """Rows of sequences computing several tokens into out, one SDPA each: a whole prompt on its own new K/V
    (causal), a later chunk or a prompt behind cached pages over its pages (gathered) with a causal mask."""
    gqa = query.shape[1] // k_cache.shape[2]
    for p in prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, n, D]
        if p.pages is None:
            k = key[rows].transpose(0, 1)[None]
            v = value[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa > 1)
        else:
            k = k_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            v = v_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scale, enable_gqa=gqa > 1)
        out[rows] = o[0].transpose(0, 1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function `transformers` calls for every attention layer; returns [1, T, Hq, D]."""
    meta: AttentionMetadata = kwargs["batchrun_attn"]
    window = kwargs.get("sliding_window")
    if window is not None and meta.max_seq_len > window:
        raise NotImplementedError(
            f"this model uses sliding-window attention ({window} tokens) and a sequence is longer than the "
            f"window; batchrun's paged attention is full causal attention. Set model.max_model_len: {window}."
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            "attention logit soft-capping is not supported by batchrun's paged attention"
        )
    assert query.shape[0] == 1, "batchrun packs every sequence into one row"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    t0 = time.perf_counter()
    out = meta.backend.forward(meta, q, k, v, k_cache, v_cache, scale)
    meta.times.add("attention", time.perf_counter() - t0)
    return out[None], None


class GatherAttention:
    """Pages gathered into a reused workspace per decode group, then SDPA; prompts attend on their own K/V."""

    name = "gather"

    def __init__(self, page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        self.workspace = Workspace()

    def prepare(self, layout: StepLayout) -> GatherPlan:
        """Decodes batched in groups of similar context length (padded, masked)."""
        rows, prefills = split_step(layout, self.page_size, self.device)
        ctx, tables, P = layout.context_lens, layout.block_tables, self.page_size
        decode = [_decode_batch(b, ctx, tables, P, self.device) for b in _buckets_by_length(rows, ctx, P)]
        return GatherPlan(decode, prefills)

    def forward(self, meta: AttentionMetadata, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan: GatherPlan = meta.plan
        out = torch.empty_like(q)
        gathered_decode_attention(out, q, k_cache, v_cache, plan.decode, scale, self.workspace)
        prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale)
        return out


@dataclass
class PagedDecode:
    """The step's decoding sequences, for the C++ kernel that reads their pages in place."""

    token_index: torch.Tensor  # [G] int64: packed row of each one's query
    block_tables: torch.Tensor  # [G, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [G] int32: context, the new token included


@dataclass
class TorchPlan:
    decode: PagedDecode | None
    prefills: list[PrefillSequence]


class TorchAttention:
    """Decoding sequences through the C++ paged-decode kernel (no copy of their pages); every other sequence
    through SDPA, as in GatherAttention."""

    name = "torch"

    def __init__(self, page_size: int, kernel):
        self.page_size = page_size
        self.kernel = kernel  # cpu_kernels.load(): the compiled module
        self.device = torch.device("cpu")

    def prepare(self, layout: StepLayout) -> TorchPlan:
        rows, prefills = split_step(layout, self.page_size, self.device)
        if not rows:
            return TorchPlan(None, prefills)
        tables = [layout.block_tables[i] for _, i in rows]
        width = max(len(t) for t in tables)
        decode = PagedDecode(
            token_index=int_tensor([start for start, _ in rows]),
            block_tables=padded_int_tensor(tables, width, torch.int32),
            seq_lens=int_tensor([layout.context_lens[i] for _, i in rows], torch.int32),
        )
        return TorchPlan(decode, prefills)

    def forward(self, meta: AttentionMetadata, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan: TorchPlan = meta.plan
        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            self.kernel.paged_decode_attention(
                out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.token_index, scale
            )
        prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale)
        return out


@dataclass
class TritonPlan:
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32: packed offsets of each sequence's query tokens
    seq_lens: torch.Tensor  # [S] int32
    query_blocks: Any  # batchrun_kernels.QueryBlocks: the grid mapping


class TritonAttention:
    """The paged Triton kernels: K/V written and read in place; the grid mapping built once per step."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, device: torch.device):
        import batchrun_kernels

        self.kernels = batchrun_kernels
        self.gqa = num_heads // num_kv_heads
        self.device = device

    def prepare(self, layout: StepLayout) -> TritonPlan:
        dev = self.device
        max_blocks = max(len(t) for t in layout.block_tables)
        query_start = [0]
        for n in layout.query_lens:
            query_start.append(query_start[-1] + n)
        return TritonPlan(
            block_tables=padded_int_tensor(layout.block_tables, max_blocks, torch.int32, dev),
            query_start_loc=int_tensor(query_start, torch.int32, dev),
            seq_lens=int_tensor(layout.context_lens, torch.int32, dev),
            query_blocks=self.kernels.plan_query_blocks(layout.query_lens, self.gqa, dev),
        )

    def forward(self, meta: AttentionMetadata, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        plan: TritonPlan = meta.plan
        self.kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.kernels.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
            plan.query_blocks,
        )


def make_backend(name: str, num_heads: int, kv_shape: Any, device: torch.device):
    """The attention backend for `engine.attention`, chosen once: auto is triton on CUDA, torch elsewhere; torch
    is the C++ paged decode on the CPU, gather where that cannot be built or on another device. `kv_shape`: the
    KVCacheShape (KV heads, page size)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        return TritonAttention(num_heads, kv_shape.num_kv_heads, device)
    if name == "torch" and device.type == "cpu":
        from . import cpu_kernels

        kernel = cpu_kernels.load()
        if kernel is not None:
            return TorchAttention(kv_shape.page_size, kernel)
    return GatherAttention(kv_shape.page_size, device)


def register() -> None:
    """Make `attn_implementation="batchrun_paged"` known to transformers (idempotent, no global patching)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
