"""batchrun's attention inside stock `transformers` models, for generation and pooling alike.

The model runs on one packed row of every token scheduled this step. `transformers` calls batchrun's attention
function (interface.py) once per layer, with q/k/v after RoPE and the step's metadata as a keyword argument. For
a generation step (`AttentionMetadata`) it writes the new K/V into their page slots and attends through the block
tables with the backend chosen once per engine (backends/); for a pooling step (`PackedLayout`) each text of the
row attends to itself and nothing is kept (packed.py). The package, by concept:

- masks.py: which earlier keys a query sees (full causal, a sliding window, chunks, one image's tokens);
- layers.py: what one layer computes, frozen at load (LayerSpec), and the terms a call adds per query token;
- metadata.py: a step's metadata, built once before the forward (common parts once, each KV cache group's
  block tables and slot mapping, each group's backend plan), and the step the forward is running;
- interface.py: the function transformers calls, which reads and checks the layer's arguments (one check for
  both paths);
- packed.py: a pooling step's packed layout and its attention (SDPA per run of texts of one length, no pages);
- reference.py: the models' own eager attention, and SDPA where it computes the same;
- backends/: `torch` (CPU: batchrun's C++ paged decode), `gather` (plain PyTorch), `triton` (GPU), each an
  `AttentionBackend` declaring its capabilities, chosen once by what it supports.

What a layer computes beyond plain causal attention arrives with its call and is honoured by every backend: a
sliding window (Mistral, Gemma 2/3, gpt-oss, ...), chunked attention (Llama 4's local layers), logit
soft-capping (Gemma 2), attention sinks (gpt-oss), and terms of each query token's own (Inkling 2's sink logits
and relative position bias). An argument batchrun does not know is an error (`UnsupportedModel`), never
ignored: the engine's load probe (architecture.py) meets it before any row runs.
"""

from batchrun.engine.attention.backends import AttentionBackend, AttentionLayers, Capabilities, make_backend
from batchrun.engine.attention.interface import ATTENTION_NAME, METADATA_KEYWORD, register
from batchrun.engine.attention.layers import LayerCall, LayerSpec, RelativeBias, UnsupportedModel, refusal
from batchrun.engine.attention.masks import FULL, MaskKind
from batchrun.engine.attention.metadata import (
    AttentionMetadata,
    AttentionServices,
    GroupMetadata,
    StepMetadata,
    int_tensor,
    products_as_generate,
)
from batchrun.engine.attention.packed import PackedLayout

__all__ = [
    "ATTENTION_NAME",
    "FULL",
    "AttentionBackend",
    "AttentionLayers",
    "AttentionMetadata",
    "AttentionServices",
    "Capabilities",
    "GroupMetadata",
    "LayerCall",
    "LayerSpec",
    "MaskKind",
    "METADATA_KEYWORD",
    "PackedLayout",
    "RelativeBias",
    "StepMetadata",
    "products_as_generate",
    "UnsupportedModel",
    "int_tensor",
    "make_backend",
    "refusal",
    "register",
]
