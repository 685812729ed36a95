"""`torch`, the CPU default: each layer's new K/V written to their pages by one C++ call (cpu_kv_write.cpp);
decodes through batchrun's C++ paged-decode kernel (engine/csrc/cpu_kernels.cpp), which reads K/V in the pages with
no copy; bf16 prompts through its prompt kernel where it applies (prompt_kernel.py),
the others through SDPA (prompts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.attention.backends.base import (
    AttentionBackend,
    AttentionLayers,
    AttentionMetadataBuilder,
)
from batchrun.engine.attention.backends.capabilities import Capabilities
from batchrun.engine.attention.backends.prompt_kernel import (
    PagedPrompts,
    StepPrompts,
    kernel_groups,
    prompt_attention,
    takes_kernel,
)
from batchrun.engine.attention.backends.prompts import (
    PrefillSequence,
    prefill_attention,
    prompt_plans,
    step_prompt_masks,
    write_kv,
)
from batchrun.engine.attention.layers import LayerCall, LayerSpec
from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.attention.metadata import AttentionMetadata, GroupMetadata, StepMetadata


@dataclass
class PagedDecode:
    """The step's decoding sequences in one group, for the kernel."""

    token_index: torch.Tensor  # [G] int64: packed row of each one's query
    block_tables: torch.Tensor  # [G, max_blocks] int32
    seq_lens: torch.Tensor  # [G] int32: context, the new token included
    first_keys: torch.Tensor | None  # [G] int32: the first key each one sees (window, chunk); None: 0


@dataclass
class TorchPlan:
    decode: PagedDecode | None
    prefills: list[PrefillSequence]  # through SDPA
    prompts: PagedPrompts | None = None  # through the C++ prompt kernel


def keys_read(step: StepMetadata, kind, page_size: int) -> int:
    """Keys the C++ decode reads per layer and KV head this step (from each first visible key's page): for
    bench/micro/profile_step.py's bytes read, counted only when asked."""
    lens = [step.context_lens[i] for i in step.decodes]
    if kind.is_full:
        return sum(lens)
    return sum(c - kind.first_key(c - 1) // page_size * page_size for c in lens)


class TorchMetadataBuilder(AttentionMetadataBuilder):
    """A step's plans for the C++ decode: each mask kind's first visible key per decode once (every group of the
    kind shares them; None for full attention); the prompts' arrays once for the groups whose prompts take the C++
    prompt kernel, their masks once per PromptMaskKind for the others; then each group's block tables."""

    def __init__(self, backend: TorchAttention, step: StepMetadata, groups: list[GroupMetadata]):
        super().__init__(backend, step, groups)
        self.first_keys: dict[MaskKind, torch.Tensor | None] = {}
        if step.decodes:
            for kind in dict.fromkeys(g.kind for g in groups):
                self.first_keys[kind] = (
                    None if kind.is_full else kind.first_keys(step.decode_context_lens - 1)
                )
        # the groups whose prompts take the C++ prompt kernel this step, decided once here for `build`
        self.kernel_groups = {g.group for g in groups if takes_kernel(g, backend.prompt_groups)}
        self.prompt_masks = step_prompt_masks(step, [g for g in groups if g.group not in self.kernel_groups])
        self.step_prompts = StepPrompts(step) if step.prompts and self.kernel_groups else None

    def build(self, group: GroupMetadata) -> TorchPlan:
        step = self.step
        prompts = prefills = None
        if self.step_prompts is not None and group.group in self.kernel_groups:
            prompts, prefills = self.step_prompts.plan(group), []
        else:
            prefills = prompt_plans(step, group, self.prompt_masks)
        if not step.decodes:
            return TorchPlan(None, prefills, prompts)
        decode = PagedDecode(
            token_index=step.decode_tokens,
            block_tables=group.block_tables
            if step.decode_only
            else group.block_tables.index_select(0, step.decode_index),
            seq_lens=step.decode_context_lens,
            first_keys=self.first_keys[group.kind],
        )
        return TorchPlan(decode, prefills, prompts)


class TorchAttention(AttentionBackend):
    """Decoding sequences through the C++ paged-decode kernel (no copy of their pages); in bf16 the others through
    the C++ prompt kernel where it applies (prompt_kernel.py), else through SDPA, as in GatherAttention."""

    # the dtypes cpu_kernels.cpp's paged decode dispatches on
    capabilities = Capabilities(
        devices=("cpu",), dtypes=(torch.float32, torch.bfloat16, torch.float16), image_blocks=True
    )
    builder = TorchMetadataBuilder

    def __init__(self, page_size: int, kernel, prompt_groups: tuple[bool, ...]):
        self.page_size = page_size
        self.kernel = kernel  # cpu_kernels.load(): the compiled module
        self.prompt_groups = prompt_groups  # per KV cache group: its prompts may take the C++ prompt kernel

    @classmethod
    def create(cls, layers: AttentionLayers, device: torch.device) -> TorchAttention | None:
        from batchrun.engine import cpu_kernels

        kernel = cpu_kernels.load()  # None: it could not be built here, and warned why
        return (
            None if kernel is None else cls(layers.kv_spec.page_size, kernel, kernel_groups(layers, kernel))
        )

    def forward(self, meta: AttentionMetadata, spec: LayerSpec, call: LayerCall, q, k, v, scale: float):
        times = meta.services.times  # its parts, where `detailed` (bench/micro/profile_step.py attention)
        k_cache, v_cache = meta.services.kv_cache.layer(spec.layer)
        plan: TorchPlan = meta.plans[spec.group]
        if spec.writes:
            with times.part(
                "write K/V, steps with prompts"
                if plan.prefills or plan.prompts
                else "write K/V, decode-only steps"
            ):
                group = meta.groups[spec.group]
                if not self.kernel.write_kv(k, v, k_cache, v_cache, group.slot_pages, group.slot_offsets):
                    write_kv(k, v, k_cache, v_cache, group)  # a layout the kernel does not take
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        if plan.decode is not None:
            d = plan.decode
            with times.part("C++ decode"):
                self.kernel.paged_decode_attention(
                    out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.token_index, scale,
                    d.first_keys, call.softcap or 0.0, call.kernel_sinks, call.kernel_relative_bias,
                    call.kernel_alibi_slopes,
                )  # fmt: skip
            if times.detailed:
                key_bytes = k_cache[0, 0].nbytes + v_cache[0, 0].nbytes
                times.count(
                    "C++ decode: K/V bytes read", keys_read(meta.step, spec.kind, self.page_size) * key_bytes
                )
        if plan.prompts is not None:
            with times.part("C++ prompts"):
                prompt_attention(self.kernel, out, q, k_cache, v_cache, plan.prompts, scale, call)
        if plan.prefills:
            with times.part("prompts' attention"):
                prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale, call)
        return out
