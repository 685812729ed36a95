"""A step's attention metadata, built once before the forward, and the step the forward is running.

`ModelRunner.prepare` builds it: what every KV cache group shares once (`StepMetadata`: each sequence's query
and context length, the tokens' positions, the decode/prompt split), what each group adds (`GroupMetadata`: its
block tables and slot mapping), then each group's backend plan (`backend.build`: the backend's metadata
builder, backends/base.py, which builds what groups share once, as named fields) and each query-scale fix's
factors. What stays lazy is only what some backends never read: `StepMetadata`'s `step_product`s (the C++
decode reads `decode_tokens`, Triton `query_start_loc` and `seq_lens`, the gather backend neither) and
`GroupMetadata.slot_mapping` (Triton's alone); each is made by the builder that reads it, still before the
forward. The forward only indexes into what was built: it makes no tensor from Python data and reads nothing
back to the host (tests/test_no_sync.py), so on a GPU a decode step could be captured as a graph.
"""

from __future__ import annotations

import array
import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.engine.attention.layers import UnsupportedModel
from batchrun.engine.attention.masks import MaskKind

_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i"}


class step_product:
    """A value of the step made on first use and kept on the instance: `functools.cached_property` without its
    lock, which Python before 3.12 takes on every first use (a step makes a dozen such values)."""

    def __init__(self, make):
        self.make, self.name, self.__doc__ = make, make.__name__, make.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.make(instance)  # later reads find it in the instance
        return value


def int_tensor(values: list[int], dtype: torch.dtype = torch.long, device: torch.device | None = None):
    """A 1-D integer tensor of Python ints, through an `array.array`'s buffer: faster than `torch.tensor`, which
    converts one element at a time (bench/RESULTS.md), and a step builds several from lists."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array.array(_ARRAY_TYPECODES[dtype], values), dtype=dtype)
    return t if device is None or device.type == "cpu" else t.to(device)


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> torch.Tensor:
    """[n] int64 0 .. n-1 on the host, made once per n: a decode step's index of its sequences (read only)."""
    return torch.arange(n)


@dataclass
class AttentionServices:
    """The engine's parts a step reaches, made once per engine: the backend, the caches a step reads and writes
    (the KV pages; a hybrid model's state slots; a vision-language model's image features), the clock, each
    attention layer's spec (LayerSpec, by layer; None: the load probe, which reads every call in full), and
    what the config says of the layers (architecture.ModelLayers: chunks, shared modules). The cache managers'
    tensors (a hybrid model's state slots: state_cache.StateCache) and the image features ride here beside the KV cache
    because they are caches alike: made once by the engine, sized from the same budget, read by the runner every
    step."""

    backend: Any  # the engine's backends.AttentionBackend (backends/base.py), or architecture.ProbeAttention
    kv_cache: Any  # kv_cache.KVCache (None for the load probe)
    times: Any  # timing.PhaseTimes: the layers add their seconds to "attention"
    specs: tuple | None  # layers.LayerSpec per layer (None where a layer has no attention)
    layers: Any = None  # architecture.ModelLayers
    # each cache manager's tensors, in the coordinator's order (a hybrid's StateCache); none: pages alone
    unit_tensors: tuple = ()
    encoder: Any = None  # multimodal.EncoderCache: image features (None: a text model)

    def __post_init__(self) -> None:
        # the distinct query-scale fixes of the layers (families.QueryScaleFix): each step computes each once
        self.scale_fixes = tuple(
            {s.scale_fix for s in self.specs or () if s is not None and s.scale_fix is not None}
        )


@dataclass
class StepMetadata:
    """What every KV cache group's metadata shares: one entry per scheduled sequence, in packed order. The
    `step_product`s are made by the first backend builder that asks (in `prepare`, never in the forward): each
    is read by some backends only, and a step whose backend does not read one does not pay for it."""

    query_lens: list[int]  # tokens computed for it this step
    context_lens: list[int]  # its context after this step (new tokens included)
    positions: torch.Tensor  # [T] int64: each packed token's position in its sequence (on the device)
    device: torch.device
    # the packed tokens as HF generate multiplies them, run by run: a prompt's tokens (the part this step computes)
    # as one product, each generated token alone, a recomputed sequence's too (`products_as_generate`); None:
    # one run per sequence (query_lens). Read by the quantized layers that compute each product apart.
    generate_products: list[int] | None = None
    # the step's tokens by LoRA adapter (lora.LoRABatch), read by the adapted linear layers; None: no token of the
    # step has an adapter
    lora: Any = None

    def __post_init__(self) -> None:
        # every sequence computes one token (the common step): token i is sequence i's
        self.decode_only = len(self.positions) == len(self.query_lens)

    @step_product
    def starts(self) -> list[int]:
        """Each sequence's first packed token."""
        if self.decode_only:
            return list(range(len(self.query_lens)))
        out, t = [], 0
        for n in self.query_lens:
            out.append(t)
            t += n
        return out

    @step_product
    def decodes(self) -> list[int]:
        """The sequences computing one token (decodes), by index."""
        if self.decode_only:
            return self.starts
        return [i for i, n in enumerate(self.query_lens) if n == 1]

    @step_product
    def prompts(self) -> list[int]:
        """The sequences computing several tokens (a prompt, or a chunk of one), by index."""
        if self.decode_only:
            return []
        return [i for i, n in enumerate(self.query_lens) if n != 1]

    @step_product
    def decode_tokens(self) -> torch.Tensor:
        """[D] int64: the packed token of each decode (on the host in a decode-only step, `decode_index` itself:
        read only)."""
        if self.decode_only:
            return self.decode_index.to(self.device)
        return int_tensor([self.starts[i] for i in self.decodes], device=self.device)

    @step_product
    def decode_index(self) -> torch.Tensor:
        """[D] int64: each decode's index among the step's sequences (host: it indexes the block tables). In a
        decode-only step one tensor per size, shared by every step (`_arange`): read only, never written."""
        return _arange(len(self.query_lens)) if self.decode_only else int_tensor(self.decodes)

    @step_product
    def decode_context_lens(self) -> torch.Tensor:
        """[D] int32: each decode's context (host)."""
        if self.decode_only:
            return int_tensor(self.context_lens, torch.int32)
        return int_tensor([self.context_lens[i] for i in self.decodes], torch.int32)

    @step_product
    def query_start_loc(self) -> torch.Tensor:
        """[S + 1] int32: packed offsets of each sequence's query tokens."""
        return int_tensor([*self.starts, sum(self.query_lens)], torch.int32, self.device)

    @step_product
    def seq_lens(self) -> torch.Tensor:
        """[S] int32: each sequence's context."""
        return int_tensor(self.context_lens, torch.int32, self.device)


@dataclass
class GroupMetadata:
    """What one KV cache group adds to the step: its block tables and where each new token's K/V goes."""

    group: int
    kind: MaskKind  # the mask of its layers
    page_size: int
    # [S, W] int32, host: each sequence's pages in this group (an entry behind the group's window may be NULL
    # = -1, or a page given back since: either way never a key the sequence sees)
    block_tables: torch.Tensor
    # [T] int64: the page of each new token's slot in this group, and its place in that page (every group's
    # are the same tensor): where `write_kv` puts its K/V
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    # per sequence: the (start, end) positions of the images among its queries whose tokens see each other
    # (multimodal.ImageBlocks, on the layers it opens); None: no such image this step
    image_blocks: list[list[tuple[int, int]]] | None = None
    token_terms: bool = False  # its layers add per-token terms or ALiBi (LayerSpec.positional)
    # some of its layers run the eager reference (soft-capping, sinks, per-token terms: not LayerCall.plain),
    # which takes a whole prompt's causal mask as a tensor where SDPA takes is_causal
    eager: bool = False

    @step_product
    def slot_mapping(self) -> torch.Tensor:
        """[T] int64: the cache slot (page * page_size + offset) of each new token (the Triton kernels' form)."""
        return self.slot_pages * self.page_size + self.slot_offsets


class AttentionMetadata:
    """One step's inputs to the layers, shared by every layer: the step's and each group's metadata, each
    group's backend plan, the query-scale factors of the layers that need them, each kind's step view (`views`,
    keyed by the kind's tensors' class: a hybrid model's state_cache.StepStates under StateCache, or the load
    probe's StateProbe; empty for a model with pages alone), and the step's rotary cos/sin where the engine computes them per sequence
    (`rotary_embeddings`). Everything is built here, before the forward."""

    def __init__(
        self,
        services: AttentionServices,
        step: StepMetadata,
        groups: list[GroupMetadata],
        views: dict | None = None,
        dtype: torch.dtype | None = None,
        rotary_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.services = services
        self.step = step
        self.groups = groups  # per KV cache group
        self.views = views or {}
        # the step's cos/sin per packed sequence (per_sequence_rope.PerSequenceRope, for LongRoPE and dynamic
        # NTK); None: the model's rotary module computes them
        self.rotary_embeddings = rotary_embeddings
        self.plans = services.backend.build(step, groups)  # per KV cache group
        self.query_scales = {
            fix: fix.factor(step.positions).to(step.device, dtype)[:, None, None]
            for fix in services.scale_fixes
        }
        self._shared_calls: dict[int, int] = {}  # id(shared module) -> its calls so far this step

    def layer_index(self, module: torch.nn.Module) -> int:
        """The layer an attention call is: the module's `layer_idx`, or for a module shared by several layers
        (none of its own), its call's place among this forward's calls of it (ModelLayers.shared_layer)."""
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and layer >= 0:
            return layer
        if self.services.layers is None:
            raise UnsupportedModel(f"{type(module).__name__} has no layer index (layer_idx={layer!r})")
        k = self._shared_calls.get(id(module), 0)
        self._shared_calls[id(module)] = k + 1
        return self.services.layers.shared_layer(module, k)

    @contextlib.contextmanager
    def running(self):
        """This step's metadata for the stateful modules called inside (stateful_layers._stateful_forward): they
        read it here, since some models do not pass their keyword arguments on to them (Jamba's decoder layer
        calls its Mamba mixer with its hidden states and cache alone). The attention layers get it from the
        keyword arguments transformers passes them."""
        token = _RUNNING.set(self)
        try:
            yield self
        finally:
            _RUNNING.reset(token)

    @staticmethod
    def current() -> AttentionMetadata | None:
        """The metadata of the step being run (`running`), or None outside one."""
        return _RUNNING.get()


_RUNNING: ContextVar[AttentionMetadata | None] = ContextVar("batchrun_step", default=None)


def products_as_generate(start: int, end: int, num_prompt_tokens: int) -> list[int]:
    """How HF `generate` multiplies a sequence's tokens [start, end): its prompt's as one product, each
    generated token alone (a recompute computes generated tokens again, which generate decoded one by one)."""
    prompt = max(0, min(end, num_prompt_tokens) - start)
    return ([prompt] if prompt else []) + [1] * (end - start - prompt)
