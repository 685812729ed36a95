"""The sequences of a step that compute several tokens (a prompt, a chunk of one, a prompt behind cached pages),
attended one by one with SDPA or the eager reference, and the K/V writes into the pages: what the CPU backends
(gather, torch) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from batchrun.engine.attention.layers import LayerCall
from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.attention.metadata import GroupMetadata, StepMetadata
from batchrun.engine.attention.reference import attend
from batchrun.engine.core.page_pool import cdiv


@dataclass
class PrefillSequence:
    """One sequence computing several tokens, with what its attention reads."""

    start: int  # first packed-token index of its queries
    num_tokens: int
    context_len: int  # tokens it attends to, its new ones included
    pages: torch.Tensor | None  # [num_blocks] int64: its block table, when earlier tokens live in the cache
    # a whole prompt attending causally to its own K/V: SDPA's is_causal, without `mask`
    causal: bool
    # [1, 1, num_tokens, num_keys] bool: the keys each query sees; None where it is causal and the group has no
    # eager layers (GroupMetadata.eager)
    mask: torch.Tensor | None
    rows: torch.Tensor | None  # [num_tokens] packed rows of its queries (layers with per-token terms)
    back: torch.Tensor | None  # [num_tokens, num_keys]: query position - key position (per-token terms)


class PromptMaskKind(NamedTuple):
    """What a group's prompt masks depend on: groups alike in these share one list of masks a step."""

    kind: MaskKind
    images: bool  # the step has image blocks in the group (GroupMetadata.image_blocks)
    eager: bool  # some layer of the group runs the eager reference (GroupMetadata.eager)

    @classmethod
    def of(cls, group: GroupMetadata) -> PromptMaskKind:
        return cls(group.kind, group.image_blocks is not None, group.eager)


PromptMasks = dict[PromptMaskKind, list[torch.Tensor | None]]


def step_prompt_masks(step: StepMetadata, groups: list[GroupMetadata]) -> PromptMasks:
    """Each distinct PromptMaskKind's masks among the step's groups, built once a step (a model of six
    windowed groups makes them once, not six times); empty on a decode-only step."""
    masks: PromptMasks = {}
    if step.prompts:
        for g in groups:
            key = PromptMaskKind.of(g)
            if key not in masks:
                masks[key] = prompt_masks(step, g)
    return masks


def prompt_masks(step: StepMetadata, group: GroupMetadata) -> list[torch.Tensor | None]:
    """Each prompt's mask for layers of this group's kind: None where a whole prompt attends causally to its
    own K/V (SDPA's is_causal) and no layer of the group runs the eager reference, which takes every mask as a
    tensor (made here, before the forward, not per layer in it)."""
    masks = []
    for i in step.prompts:
        q, c = step.query_lens[i], step.context_lens[i]
        images = group.image_blocks[i] if group.image_blocks is not None else None
        query_pos = torch.arange(c - q, c, device=step.device)
        key_pos = None
        if c > q:  # earlier tokens are in the cache: read through the block table
            key_pos = torch.arange(cdiv(c, group.page_size) * group.page_size, device=step.device)
        elif images or not group.kind.is_full or group.eager:  # a whole prompt: windowed, ..., eager
            key_pos = query_pos
        masks.append(None if key_pos is None else group.kind.visible(query_pos, key_pos, images)[None, None])
    return masks


def prompt_plans(step: StepMetadata, group: GroupMetadata, masks: PromptMasks) -> list[PrefillSequence]:
    """A PrefillSequence for every sequence of the step computing several tokens, in this group (with each
    query's row and how far behind it each key is, where the group's layers add per-token terms). `masks`:
    the step's prompt masks (step_prompt_masks)."""
    if not step.prompts:
        return []
    out = []
    for i, mask in zip(step.prompts, masks[PromptMaskKind.of(group)]):
        q, c, start = step.query_lens[i], step.context_lens[i], step.starts[i]
        images = group.image_blocks is not None and group.image_blocks[i]
        pages = None
        if c > q:  # a page behind the window (NULL) is masked: page 0 stands in for it
            pages = group.block_tables[i, : cdiv(c, group.page_size)].clamp(min=0).long().to(step.device)
        rows = back = None
        if group.token_terms:
            rows = torch.arange(start, start + q, device=step.device)
            num_keys = q if pages is None else len(pages) * group.page_size
            back = torch.arange(c - q, c, device=step.device)[:, None] - torch.arange(
                num_keys, device=step.device
            )
        causal = c == q and group.kind.is_full and not images
        out.append(PrefillSequence(start, q, c, pages, causal, mask, rows, back))
    return out


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSequence],
    scale: float,
    call: LayerCall,
) -> None:
    """Rows of sequences computing several tokens into out, one attention call each: a whole prompt on its own
    new K/V (causal, or the mask of its kind), a later chunk or a prompt behind cached pages over its pages
    (gathered) with its mask."""
    for p in prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, n, Dk]
        if p.pages is None:
            k = key[rows].transpose(0, 1)[None]
            v = value[rows].transpose(0, 1)[None]
        else:
            k = k_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, ctx, Dk]
            v = v_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]
        terms = None if p.back is None else call.terms(p.rows[None], p.back[None])
        o = attend(q, k, v, p.mask, scale, call, causal=p.causal, terms=terms)
        out[rows] = o[0].transpose(0, 1)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: GroupMetadata
) -> None:
    """key/value [T, Hkv, Dk|Dv] into the pages [num_pages, P, Hkv, Dk|Dv] (a view with the pool's page stride,
    kv_cache.py) at each token's page and offset."""
    if key.shape[0] > 64:  # a prompt's K/V arrive head-major; the copy is faster from a contiguous tensor
        key, value = key.contiguous(), value.contiguous()
    index = (group.slot_pages, group.slot_offsets)
    k_cache.index_put_(index, key)
    v_cache.index_put_(index, value)
