"""`triton`, the GPU default: the paged kernels in `batchrun_kernels`, which write and read K/V in place. The
grid mapping is built once per step for each distinct number of query heads per KV head; the mask kind,
soft-capping, sinks and relative bias are arguments of the kernel."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.engine.attention.backends.base import (
    AttentionBackend,
    AttentionLayers,
    AttentionMetadataBuilder,
)
from batchrun.engine.attention.backends.capabilities import Capabilities
from batchrun.engine.attention.layers import LayerCall, LayerSpec
from batchrun.engine.attention.metadata import AttentionMetadata, GroupMetadata, StepMetadata


@dataclass
class TritonPlan:
    block_tables: torch.Tensor  # [S, max_blocks] int32, on the device
    query_start_loc: torch.Tensor  # [S + 1] int32: packed offsets of each sequence's query tokens
    seq_lens: torch.Tensor  # [S] int32
    query_blocks: Any  # batchrun_kernels.QueryBlocks: the grid mapping


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """A step's Triton plans: the grid mapping once per distinct number of query heads per KV head among the
    step's groups; then each group's block tables on the device and slot mapping."""

    def __init__(self, backend: TritonAttention, step: StepMetadata, groups: list[GroupMetadata]):
        super().__init__(backend, step, groups)
        self.query_blocks: dict[int, Any] = {  # gqa -> batchrun_kernels.QueryBlocks
            gqa: backend.kernels.plan_query_blocks(step.query_lens, gqa, backend.device)
            for gqa in dict.fromkeys(backend.gqa[g.group] for g in groups)
        }

    def build(self, group: GroupMetadata) -> TritonPlan:
        step, backend = self.step, self.backend
        group.slot_mapping  # noqa: B018 - made now, before the forward
        return TritonPlan(
            block_tables=group.block_tables.to(backend.device, non_blocking=True),
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            query_blocks=self.query_blocks[backend.gqa[group.group]],
        )


class TritonAttention(AttentionBackend):
    """The paged Triton kernels: K/V written and read in place (a group's query heads per KV head, of its
    layers' shape, set the grid)."""

    # one image's tokens seeing each other (Gemma's image blocks) is a mask the kernels do not compute; they take
    # one head dim for keys and values. Their dtypes, page sizes and head dims: batchrun_kernels says
    # (`unsupported_shape`).
    capabilities = Capabilities(devices=("cuda",), image_blocks=False, unequal_head_dims=False)
    builder = TritonMetadataBuilder

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        """CUDA; or, asked by name, any device under Triton's interpreter (TRITON_INTERPRET=1: the tests)."""
        return super().runs_on(device) or os.environ.get("TRITON_INTERPRET") == "1"

    @classmethod
    def unsupported_shape(cls, layers: AttentionLayers) -> str | None:
        import batchrun_kernels

        spec = layers.kv_spec
        for shape, gqa in zip(spec.groups.shapes, layers.gqa):
            why = batchrun_kernels.unsupported_reason(
                spec.dtype, spec.page_size, shape.head_dim, shape.v_head_dim, gqa
            )
            if why:
                return why
        return None

    @classmethod
    def create(cls, layers: AttentionLayers, device: torch.device) -> TritonAttention:
        return cls(layers.gqa, device)

    def __init__(self, gqa: tuple[int, ...], device: torch.device):
        import batchrun_kernels

        self.kernels = batchrun_kernels
        self.gqa = gqa  # per KV cache group
        self.device = device

    def forward(self, meta: AttentionMetadata, spec: LayerSpec, call: LayerCall, q, k, v, scale: float):
        k_cache, v_cache = meta.services.kv_cache.layer(spec.layer)
        plan: TritonPlan = meta.plans[spec.group]
        if spec.writes:
            self.kernels.write_kv_cache(k, v, k_cache, v_cache, meta.groups[spec.group].slot_mapping)
        return self.kernels.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
            plan.query_blocks,
            window=call.kind.window or 0,
            chunk=call.kind.chunk or 0,
            softcap=call.softcap or 0.0,
            sinks=call.sink_logits,
            relative_bias=call.relative_bias,
            alibi_slopes=call.alibi_slopes,
        )
