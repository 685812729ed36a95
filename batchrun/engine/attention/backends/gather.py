"""`gather`: plain PyTorch. Each group of decodes of similar context length has its pages gathered into a
reused workspace and attended with SDPA (or the eager reference); prompts attend on their own K/V or their
gathered pages (prompts.py). What `torch` falls back to where the C++ kernel cannot be built, and what that
kernel was measured against (bench/RESULTS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...page_pool import cdiv
from ..layers import LayerCall, LayerSpec
from ..metadata import AttentionMetadata, GroupMetadata, StepMetadata, int_tensor
from ..reference import eager_attention
from .base import AttentionBackend, AttentionLayers
from .capabilities import Capabilities
from .prompts import PrefillSequence, prefill_attention, prompt_plans, write_kv


@dataclass
class DecodeBatch:
    """Decoding sequences (one query token each) attended together over their gathered pages."""

    token_index: torch.Tensor  # [G] packed-token index of each sequence's query
    back: (
        torch.Tensor | None
    )  # [G, 1, num_blocks * page_size]: query position - key position (per-token terms)
    page_index: torch.Tensor  # [G * num_blocks] block tables, flattened (padded with page 0)
    mask: torch.Tensor  # [G, 1, 1, num_blocks * page_size] bool: key j is in the sequence's context
    num_blocks: int


@dataclass
class GatherPlan:
    decode: list[DecodeBatch]
    prefills: list[PrefillSequence]


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


def buckets_by_length(step: StepMetadata, page_size: int, slack: float = 0.8) -> list[list[int]]:
    """The step's decodes (sequence indices) in groups of similar context length: each group is padded to its
    longest context, and one padded group of very different lengths reads (and attends over) up to several
    times the K/V."""
    ctx = step.context_lens
    buckets: list[list[int]] = []
    for i in sorted(step.decodes, key=lambda i: ctx[i], reverse=True):
        blocks = cdiv(ctx[i], page_size)
        if buckets and blocks >= slack * cdiv(ctx[buckets[-1][0]], page_size):
            buckets[-1].append(i)
        elif buckets and len(buckets) >= 6:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def decode_batches(step: StepMetadata, group: GroupMetadata) -> list[DecodeBatch]:
    """The group's decodes in batches of similar length: the masks shared by every group of its kind, the
    pages its own."""
    P = group.page_size

    def make():
        out = []
        for bucket in step.shared_product(("decode buckets", P), lambda: buckets_by_length(step, P)):
            num_blocks = max(cdiv(step.context_lens[i], P) for i in bucket)
            ctx = int_tensor([step.context_lens[i] for i in bucket], device=step.device)
            key_pos = torch.arange(num_blocks * P, device=step.device)
            mask = key_pos[None, :] < ctx[:, None]
            if not group.kind.is_full:
                mask &= key_pos[None, :] >= group.kind.first_keys(ctx - 1)[:, None]
            tokens = int_tensor([step.starts[i] for i in bucket], device=step.device)
            out.append((int_tensor(bucket), tokens, ctx - 1, mask[:, None, None, :], num_blocks))
        return out

    batches = []
    for index, tokens, query_pos, mask, num_blocks in step.shared_product(("decode masks", group.kind), make):
        # pages behind a window (NULL = -1) are masked: page 0 stands in for them
        pages = group.block_tables[index, :num_blocks].clamp(min=0).long().view(-1).to(step.device)
        back = None
        if group.token_terms:
            back = (query_pos[:, None] - torch.arange(num_blocks * P, device=step.device))[:, None, :]
        batches.append(DecodeBatch(tokens, back, pages, mask, num_blocks))
    return batches


def gathered_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode: list[DecodeBatch],
    scale: float,
    call: LayerCall,
    workspace: Workspace,
) -> None:
    """Decoding rows of query [T, Hq, Dk] into out [T, Hq, Dv]: each batch's pages gathered into the workspace,
    then attended."""
    num_heads, head_dim = query.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1:3]
    v_dim = v_cache.shape[3]
    gqa = num_heads // num_kv_heads
    for batch in decode:
        G = batch.token_index.shape[0]
        ctx = batch.num_blocks * page_size
        # GQA: the query heads of one KV head become the query rows of that head
        q = query[batch.token_index].view(G, num_kv_heads, gqa, head_dim)
        k = workspace.get("k", (G * batch.num_blocks, page_size, num_kv_heads, head_dim), k_cache)
        v = workspace.get("v", (G * batch.num_blocks, page_size, num_kv_heads, v_dim), v_cache)
        torch.index_select(k_cache, 0, batch.page_index, out=k)
        torch.index_select(v_cache, 0, batch.page_index, out=v)
        k = k.view(G, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(G, ctx, num_kv_heads, v_dim).transpose(1, 2)
        if call.plain:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=batch.mask, scale=scale
            )  # [G, Hkv, gqa, Dv]
        else:  # the eager path wants query heads as heads: [G, Hq, 1, Dk]
            terms = call.terms(batch.token_index[:, None], batch.back)
            o = eager_attention(q.reshape(G, num_heads, 1, head_dim), k, v, batch.mask, scale, call, terms)
        out[batch.token_index] = o.reshape(G, num_heads, v_dim)


class GatherAttention(AttentionBackend):
    """Pages gathered into a reused workspace per decode batch, then SDPA; prompts attend on their own K/V."""

    capabilities = Capabilities(devices=None, image_blocks=True)

    def __init__(self, page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        self.workspace = Workspace()

    @classmethod
    def create(cls, layers: AttentionLayers, device: torch.device) -> GatherAttention:
        return cls(layers.kv_spec.page_size, device)

    def build(self, step: StepMetadata, group: GroupMetadata) -> GatherPlan:
        return GatherPlan(decode_batches(step, group), prompt_plans(step, group))

    def forward(self, meta: AttentionMetadata, spec: LayerSpec, call: LayerCall, q, k, v, scale: float):
        k_cache, v_cache = meta.services.kv_cache.layer(spec.layer)
        group = meta.groups[spec.group]
        if spec.writes:
            write_kv(k, v, k_cache, v_cache, group)
        plan: GatherPlan = meta.plans[spec.group]
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        gathered_decode_attention(out, q, k_cache, v_cache, plan.decode, scale, call, self.workspace)
        prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale, call)
        return out
