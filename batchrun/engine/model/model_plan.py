"""The model plan: what the engine knows of its model, found once at load and never derived again.

The load probe (architecture.inspect_model) runs the model once under a recording attention and fixes each
layer's spec, the KV cache groups and a hybrid's states; the family adapters (families/) add the image rules; the
quantization module says whether a prompt must be one product. The plan holds all of it, so the Engine, the
ModelRunner and the Scheduler each take the plan rather than a list of flags handed down, and a new rule is one
field here and its reader there.

`ModelPlan.of(model, ...)` is the model's own facts; `for_backend(capabilities)` narrows them to what the chosen
attention backend computes (Gemma's bidirectional image blocks need a backend that computes them; without one
the model's images are refused, its text still runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from batchrun.engine.attention import refusal as refusal_of
from batchrun.engine.core.cache_spec import KVCacheSpec
from batchrun.engine.core.scheduler_output import ChunkRules
from batchrun.engine.model import families
from batchrun.engine.model.architecture import ModelAttention, inspect_model
from batchrun.engine.model.families import ImageBlocks, MRope
from batchrun.engine.model.lora.layers import LoRAManager, manager_of
from batchrun.engine.model.multimodal import image_token_id, images_unsupported_reason
from batchrun.engine.model.ops.per_sequence_rope import PerSequenceRope
from batchrun.engine.model.quantization import computes_each_prompt_whole, computes_per_sequence
from batchrun.engine.model.sizing import model_max_len
from batchrun.engine.model.structure import text_config
from batchrun.vocabulary import embedding_rows


@dataclass(frozen=True)
class ImageRules:
    """How a vision-language model's image tokens run: whether one image's tokens attend to each other (Gemma's
    `ImageBlocks`; None: causal), and their rotary positions (Qwen-VL's 3-D `MRope`; None: each token at its
    index)."""

    blocks: ImageBlocks | None = None
    positions: MRope | None = None


@dataclass(frozen=True)
class GroupCalls:
    """Per KV cache group, what its layers' calls ask of a step's metadata (attention.GroupMetadata), read once
    from the layer specs: whether any adds per-token terms or ALiBi (its prompts then need each query's row and
    position: LayerSpec.positional), and whether any runs the eager reference. A group's mask kind is the KV
    groups' own (KVGroups.mask_kinds)."""

    token_terms: tuple[bool, ...]
    eager: tuple[bool, ...]

    @classmethod
    def of(cls, specs: tuple, num_groups: int) -> GroupCalls:
        members = [[s for s in specs if s is not None and s.group == g] for g in range(num_groups)]
        return cls(
            tuple(any(s.positional for s in m) for m in members),
            tuple(any(s.token_terms or not s.call.plain for s in m) for m in members),
        )


@dataclass(frozen=True)
class ModelPlan:
    attention: ModelAttention  # per-layer specs, KV groups, a hybrid's states, per-sequence rope
    layer_specs: tuple  # each attention layer's spec (attention.LayerSpec; None: no attention), fixed at load
    group_calls: GroupCalls  # per KV cache group, what its layers' calls need of a step
    kv_spec: KVCacheSpec  # the pages those groups form, at the engine's page size and the model's dtype
    max_model_len: int  # prompt + completion, the model's limit or the job's lower one
    vocab_size: int  # the logits' width
    embedding_rows: int  # a prompt's token ids must be below it
    chunks: ChunkRules
    # prefix sharing is exact for this model (False: a prompt must be one product of its own)
    shares_prefixes: bool
    # some quantized layer computes each sequence apart: a step carries HF generate's runs of tokens
    generate_products: bool
    images: ImageRules | None  # None: this model takes no images here (images_refusal says why)
    images_refusal: str | None
    image_token_id: int | None  # the token that holds an image's place in a prompt (None: none)
    lora: LoRAManager | None = None  # the LoRA adapters attached to the model (lora.attach); None: none

    @classmethod
    def of(cls, model: torch.nn.Module, page_size: int, max_model_len: int | None = None) -> ModelPlan:
        """Probes `model` (refusing what cannot run exactly, before any page is made) and reads its rules."""
        attention = inspect_model(model)
        encoder = [i for i, call in enumerate(attention.calls) if call is not None and not call.kind.causal]
        if encoder:  # the probe reads an encoder's layers too (a pooling runner's load)
            raise refusal_of(
                attention.architecture,
                f"layers {', '.join(map(str, encoder))} attend to later tokens too (non-causal attention); "
                "batchrun generates with causal language models (an encoder runs as a pooling task)",
            )
        dtype = next(model.parameters()).dtype
        whole = computes_each_prompt_whole(model)
        refusal = images_unsupported_reason(model)
        images = None
        if refusal is None:
            images = ImageRules(families.image_blocks(model), families.image_positions(model))
        rope: PerSequenceRope | None = attention.rope
        specs = attention.layer_specs()
        return cls(
            attention=attention,
            layer_specs=specs,
            group_calls=GroupCalls.of(specs, attention.groups.num_groups),
            kv_spec=attention.kv_spec(page_size, dtype),
            max_model_len=min(model_max_len(model.config), max_model_len or 1 << 62),
            vocab_size=text_config(model.config).vocab_size,
            embedding_rows=embedding_rows(model),
            chunks=ChunkRules(
                # stateful layers that cannot continue over several tokens (a hybrid's Jamba-like scan)
                whole_prompts=whole
                or (attention.states is not None and not attention.states.continues_state),
                whole_images=images is not None and images.blocks is not None,
                recompute_at=rope.recompute_at if rope is not None else None,
            ),
            shares_prefixes=not whole,
            generate_products=computes_per_sequence(model),
            images=images,
            images_refusal=refusal,
            image_token_id=image_token_id(model.config),
            lora=manager_of(model),
        )

    def for_backend(self, capabilities, backend_name: str) -> ModelPlan:
        """The plan as the chosen attention backend runs it: a model whose image tokens attend to each other
        takes no images on a backend that does not compute that."""
        if self.images is None or self.images.blocks is None or capabilities.image_blocks:
            return self
        return dataclasses.replace(
            self,
            images=None,
            images_refusal=f"one image's tokens attend to each other, which attention `{backend_name}` does "
            "not compute",
            chunks=dataclasses.replace(self.chunks, whole_images=False),
        )

    @property
    def rope(self) -> PerSequenceRope | None:
        return self.attention.rope
