"""bf16 prompts through batchrun's C++ prompt kernel (engine/csrc/cpu_prompt_attention.cpp): every sequence of a step
computing several tokens (a whole prompt, a later chunk, a prompt behind cached pages) in one call per layer, its
K/V read in the pages, where SDPA (prompts.py) ran once per prompt and gained nothing from bf16. Where the kernel
does not apply the prompts stay on SDPA: fp32 (its tokens equal HF generate's, a promise) and fp16 pages, a build
without AVX512-BF16, head dims it does not take, image blocks (bidirectional within an image) and per-token
terms. Soft-capping and a sink logit per head (the layers SDPA leaves to the eager reference) are the kernel's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.attention.backends.base import AttentionLayers
from batchrun.engine.attention.metadata import GroupMetadata, StepMetadata, int_tensor


@dataclass
class PagedPrompts:
    """The step's sequences computing several tokens, in one group, for the kernel."""

    block_tables: torch.Tensor  # [S, W] int32: each one's pages in the group
    starts: torch.Tensor  # [S] int32: the packed row of each one's first query
    query_lens: torch.Tensor  # [S] int32
    context_lens: torch.Tensor  # [S] int32: each one's context, its queries included
    window: int  # the group's sliding window (MaskKind); 0: none
    chunk: int  # its chunk; 0: none


def kernel_groups(layers: AttentionLayers, kernel) -> tuple[bool, ...]:
    """Per KV cache group, whether its pages and shapes are the kernel's: bf16, head dims and query heads per KV
    head this build takes (the kernel's `prompt_attention_bf16_supported`: none without AVX512-BF16). Decided
    once, when the backend is made."""
    shapes = layers.kv_spec.groups.shapes
    if layers.kv_spec.dtype != torch.bfloat16:
        return (False,) * len(shapes)
    return tuple(
        kernel.prompt_attention_bf16_supported(s.head_dim, s.v_head_dim, gqa)
        for s, gqa in zip(shapes, layers.gqa)
    )


def takes_kernel(group: GroupMetadata, groups: tuple[bool, ...]) -> bool:
    """Whether this step's prompts of the group go to the kernel (`groups`: kernel_groups)."""
    return groups[group.group] and group.image_blocks is None and not group.token_terms


class StepPrompts:
    """The step's prompt arrays the kernel reads, made once a step (every group shares them); each group then
    selects its block tables' rows."""

    def __init__(self, step: StepMetadata):
        prompts = step.prompts
        self.index = int_tensor(prompts)
        self.starts = int_tensor([step.starts[i] for i in prompts], torch.int32)
        self.query_lens = int_tensor([step.query_lens[i] for i in prompts], torch.int32)
        self.context_lens = int_tensor([step.context_lens[i] for i in prompts], torch.int32)

    def plan(self, group: GroupMetadata) -> PagedPrompts:
        kind = group.kind
        return PagedPrompts(
            group.block_tables.index_select(0, self.index),
            self.starts,
            self.query_lens,
            self.context_lens,
            kind.window or 0,
            kind.chunk or 0,
        )


def prompt_attention(kernel, out, query, k_cache, v_cache, plan: PagedPrompts, scale: float, call) -> None:
    """The prompts' rows of `out`, from their queries and the pages (their K/V written there first)."""
    kernel.paged_prompt_attention(
        out, query, k_cache, v_cache, plan.block_tables, plan.starts, plan.query_lens, plan.context_lens, scale,
        plan.window, plan.chunk, call.softcap or 0.0, call.kernel_sinks,
    )  # fmt: skip
