"""`gather`: plain PyTorch. Each group of decodes of similar context length has its pages gathered into a
reused workspace and attended with SDPA (or the eager reference); prompts attend on their own K/V or their
gathered pages (prompts.py). What `torch` falls back to where the C++ kernel cannot be built, and what that
kernel was measured against (bench/RESULTS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchrun.engine.attention.backends.base import (
    AttentionBackend,
    AttentionLayers,
    AttentionMetadataBuilder,
)
from batchrun.engine.attention.backends.capabilities import Capabilities
from batchrun.engine.attention.backends.prompts import (
    PrefillSequence,
    prefill_attention,
    prompt_plans,
    step_prompt_masks,
    write_kv,
)
from batchrun.engine.attention.layers import LayerCall, LayerSpec
from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.attention.metadata import AttentionMetadata, GroupMetadata, StepMetadata, int_tensor
from batchrun.engine.attention.reference import eager_attention
from batchrun.engine.core.page_pool import cdiv


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
class DecodeBucket:
    """Decodes of similar context length, as every group of one mask kind sees them (their pages are each
    group's own)."""

    index: torch.Tensor  # [G] int64, host: each one's index among the step's sequences (rows of the tables)
    token_index: torch.Tensor  # [G] packed-token index of each one's query
    query_pos: torch.Tensor  # [G]: each one's query position
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


def decode_buckets(
    step: StepMetadata, kind: MaskKind, buckets: list[list[int]], page_size: int
) -> list[DecodeBucket]:
    """The step's decode buckets (buckets_by_length) with the masks of layers of `kind`."""
    P, out = page_size, []
    for bucket in buckets:
        num_blocks = max(cdiv(step.context_lens[i], P) for i in bucket)
        ctx = int_tensor([step.context_lens[i] for i in bucket], device=step.device)
        key_pos = torch.arange(num_blocks * P, device=step.device)
        # [G, keys]: each decode's query (at ctx - 1) under the one mask rule of masks.py
        mask = kind.visible(ctx - 1, key_pos)
        tokens = int_tensor([step.starts[i] for i in bucket], device=step.device)
        out.append(DecodeBucket(int_tensor(bucket), tokens, ctx - 1, mask[:, None, None, :], num_blocks))
    return out


def decode_batches(
    group: GroupMetadata, buckets: list[DecodeBucket], device: torch.device
) -> list[DecodeBatch]:
    """The group's decodes in batches of similar length: the buckets' masks (its kind's), the pages its own."""
    batches = []
    for b in buckets:
        # pages behind a window (NULL = -1) are masked: page 0 stands in for them
        pages = group.block_tables[b.index, : b.num_blocks].clamp(min=0).long().view(-1).to(device)
        back = None
        if group.token_terms:
            keys = torch.arange(b.num_blocks * group.page_size, device=device)
            back = (b.query_pos[:, None] - keys)[:, None, :]
        batches.append(DecodeBatch(b.token_index, back, pages, b.mask, b.num_blocks))
    return batches


class GatherMetadataBuilder(AttentionMetadataBuilder):
    """A step's gather plans: the decodes bucketed by length once, each mask kind's bucket masks once (every
    group of the kind shares them), the prompts' masks once per PromptMaskKind; then each group's pages."""

    def __init__(self, backend: GatherAttention, step: StepMetadata, groups: list[GroupMetadata]):
        super().__init__(backend, step, groups)
        buckets = buckets_by_length(step, backend.page_size)  # none on a step without decodes
        self.decode_buckets: dict[MaskKind, list[DecodeBucket]] = {
            kind: decode_buckets(step, kind, buckets, backend.page_size)
            for kind in dict.fromkeys(g.kind for g in groups)
        }
        self.prompt_masks = step_prompt_masks(step, groups)

    def build(self, group: GroupMetadata) -> GatherPlan:
        step = self.step
        return GatherPlan(
            decode_batches(group, self.decode_buckets[group.kind], step.device),
            prompt_plans(step, group, self.prompt_masks),
        )


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
    builder = GatherMetadataBuilder

    def __init__(self, page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        self.workspace = Workspace()

    @classmethod
    def create(cls, layers: AttentionLayers, device: torch.device) -> GatherAttention:
        return cls(layers.kv_spec.page_size, device)

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
