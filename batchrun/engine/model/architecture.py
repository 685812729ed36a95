"""What batchrun learns of a model's attention at load, and the models it refuses there.

batchrun runs the stock `transformers` model code and replaces only its attention function. That computes what
the model computes when (a) every layer's attention goes through transformers' attention interface, passing on
the step's keyword arguments, (b) every argument of those calls is one batchrun honours (attention.interface.read_call),
and (c) every layer that keeps a state from one step to the next keeps it where batchrun can give it a state
slot (below). A model that fails any of these is refused here, naming the architecture and the reason, before
any row runs: never a row error later, never a silent difference.

`inspect_model` checks the config first (encoder-decoder models, layer types that are not attention, stateful
modules), then runs a probe: one forward of a few tokens through the very attention function the engine uses,
with a backend that records each layer's call. The probe also yields the facts the engine sizes its pages from:
each layer's mask kind and K/V shapes as the layers actually produce them (MLA models have wider keys than
values; Gemma 4's full layers have other head dims than its sliding ones), and the layers handed an earlier
layer's K/V (KV sharing).

Hybrid models (linear attention, Mamba or short convolutions beside attention) keep a state per sequence in
those layers: before the probe's forward, their modules are routed to the step's state slots (stateful_layers.py,
refusing one batchrun cannot give a slot), and the state probe (state_cache.StateProbe) stands in for the slots
and records the state shapes the model's own code creates and whether their prompt form continues a state it is
given (`ModelAttention.states`, a cache_spec.StateSpec).

What particular families compute around their attention (Llama 4's query scale, Inkling 2's relative bias and
its attention over earlier blocks), and the families refused by what their modules are (sparse attention,
states kept outside the cache interface), are the family adapters' rules (families/): this module asks them,
and installs their changes before the probe.
RoPE scalings whose factors depend on the sequence's length (LongRoPE, dynamic NTK) get them per packed sequence
(per_sequence_rope.py), also installed here.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field

import torch

from batchrun.engine.attention import (
    AttentionMetadata,
    AttentionServices,
    LayerCall,
    LayerSpec,
    MaskKind,
    StepMetadata,
    UnsupportedModel,
    refusal,
)
from batchrun.engine.attention.reference import attend
from batchrun.engine.core.cache_spec import KVCacheSpec, KVGroups, KVShape, StateSpec
from batchrun.engine.model import families
from batchrun.engine.model.families import QueryScaleFix
from batchrun.engine.model.ops.per_sequence_rope import PerSequenceRope
from batchrun.engine.model.state_cache import StateProbe
from batchrun.engine.model.stateful_layers import prepare_stateful_layers, stateful_modules
from batchrun.engine.model.structure import decoder_of, text_config

# layer types that neither attend nor keep a state: feed-forward blocks alone (Nemotron-H's `mlp` and `moe`)
FEED_FORWARD_LAYER_TYPES = frozenset({"mlp", "moe"})


@dataclass(frozen=True)
class ModelLayers:
    """Per layer, what the calls do not say: the window or chunk the model's own mask applies (`model_masks`),
    a query-scale fix, and the layers of shared attention modules."""

    chunks: tuple[int | None, ...] = ()
    # the window of each layer's mask as the model builds it (Phi-MoE passes none to its attention call)
    windows: tuple[int | None, ...] = ()
    scale_fixes: tuple[QueryScaleFix | None, ...] = ()
    # an attention module without a layer index of its own is shared by several layers (Zamba 2's shared
    # transformer block, called by each of its layers with the layer as an argument the attention never sees):
    # its k-th call in a forward is a layer of its own, numbered from `first_shared` on in the order first met
    first_shared: int = 0
    shared: dict = field(default_factory=dict, compare=False)  # (id(module), k) -> layer

    def shared_layer(self, module: torch.nn.Module, occurrence: int) -> int:
        return self.shared.setdefault((id(module), occurrence), self.first_shared + len(self.shared))

    def chunk(self, layer: int) -> int | None:
        return self.chunks[layer] if layer < len(self.chunks) else None

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def query_scale_fix(self, layer: int) -> QueryScaleFix | None:
        return self.scale_fixes[layer] if layer < len(self.scale_fixes) else None


@dataclass(frozen=True)
class ModelAttention:
    """What the probe found: each layer's mask kind and K/V shape, the query heads, and the per-layer facts."""

    architecture: str
    layers: ModelLayers
    num_layers: int
    num_heads: int  # query heads (of every attention layer)
    layer_kv: tuple[tuple[MaskKind, KVShape] | None, ...]  # per layer; None: a layer without attention
    calls: tuple[LayerCall | None, ...]  # per layer: its call as the probe read it
    kv_reads: tuple[tuple[int, int], ...] = ()  # (layer, earlier layer whose K/V it was given: KV sharing)
    states: StateSpec | None = None  # what a hybrid's stateful layers keep per sequence (None: no such layer)
    # RoPE factors chosen per sequence (LongRoPE, dynamic NTK); None: the model's own call, the same for all
    rope: PerSequenceRope | None = field(default=None, compare=False)

    @property
    def groups(self) -> KVGroups:
        return KVGroups.of_layers(list(self.layer_kv), dict(self.kv_reads))

    def kv_spec(self, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The pages: P tokens of one KV cache group's layers each."""
        return KVCacheSpec(self.groups, page_size, dtype)

    def layer_specs(self) -> tuple[LayerSpec | None, ...]:
        """Each attention layer's spec, fixed from now on (None for a layer without attention)."""
        groups = self.groups
        return tuple(
            None
            if call is None
            else LayerSpec(
                layer=i,
                group=groups.layer_group[i],
                writes=i not in groups.readers,
                call=dataclasses.replace(
                    call, token_scores=None
                ),  # the probe's terms: each call brings its own
                token_terms=call.token_scores is not None,
                scale_fix=self.layers.query_scale_fix(i),
            )
            for i, call in enumerate(self.calls)
        )


class ProbeAttention:
    """The probe's backend: records each layer's call and attends over the probe's own tokens (no pages)."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: dict[int, tuple] = {}
        # each layer's K/V, held so that no address is reused within the probe (kv_reads)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def build(self, step, groups) -> list:
        return [None for _ in groups]

    def forward(self, meta: AttentionMetadata, spec: LayerSpec, call: LayerCall, q, k, v, scale: float):
        layer = spec.layer
        if layer in self.calls:
            raise UnsupportedModel(
                f"the attention of layer {layer} is called twice in one forward (a module shared by several "
                "layers), and batchrun's pages hold one set of K/V per layer"
            )
        self.calls[layer] = (q.shape[1], k.shape[1], k.shape[2], v.shape[2], call)
        self.kv[layer] = (k, v)
        pos = torch.arange(q.shape[0], device=q.device)
        heads_first = lambda x: x.transpose(0, 1)[None]
        mask = call.kind.visible(pos, pos)[None, None]
        terms = call.terms(pos[None], (pos[:, None] - pos[None, :])[None])
        o = attend(heads_first(q), heads_first(k), heads_first(v), mask, scale, call, terms=terms)
        return o[0].transpose(0, 1)


def not_the_models_fault(e: BaseException) -> bool:
    """A failure of the machine, not of the model under batchrun: out of memory (CUDA's or the CPU allocator's),
    I/O. Only a model batchrun cannot compute is a bad job (exit 2, final for Slurm and Ray); these keep their
    own error."""
    if isinstance(e, MemoryError | OSError | torch.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "not enough memory" in text)


def rope_types(cfg) -> set[str]:
    """The RoPE scaling types a config asks for (transformers 5's `rope_parameters`, per layer type or one)."""
    found = set()
    for source in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if not isinstance(source, dict):
            continue
        values = source.values() if all(isinstance(v, dict) for v in source.values()) and source else [source]
        found |= {v.get("rope_type") or v.get("type") for v in values if isinstance(v, dict)}
    return {t for t in found if t}


def check_config(model) -> ModelLayers:
    """The config's verdict, before any forward; the per-layer facts it gives."""
    cfg = text_config(model.config)
    arch = model.config.model_type
    if getattr(model.config, "is_encoder_decoder", False):
        raise refusal(arch, "an encoder-decoder model; batchrun runs decoder-only causal language models")
    reason = families.refusal(model)  # a family adapter's (sparse attention)
    if reason is not None:
        raise refusal(arch, reason)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if "chunked_attention" in layer_types and not getattr(cfg, "attention_chunk_size", None):
        raise refusal(arch, "chunked-attention layers without `attention_chunk_size` in the config")
    fixes = families.query_scale_fixes(model)
    num_layers = max([len(layer_types), *[i + 1 for i in fixes]])
    scale_fixes = tuple(fixes.get(i) for i in range(num_layers)) if fixes else ()
    indices = [m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    first_shared = max([cfg.num_hidden_layers - 1, *indices]) + 1
    chunks = model_masks(model, cfg, "chunked_attention", first_shared)
    windows = model_masks(model, cfg, "sliding_attention", first_shared)
    return ModelLayers(chunks, windows, scale_fixes, first_shared)


# layer type -> the transformers mask builder (masking_utils) of its local mask, and the config key it reads
MASK_BUILDERS = {
    "chunked_attention": ("create_chunked_causal_mask", "attention_chunk_size"),
    "sliding_attention": ("create_sliding_window_causal_mask", "sliding_window"),
}


def model_masks(model, cfg, layer_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the chunk or window (by `layer_type`: MASK_BUILDERS) of the mask the model builds for it. HF's
    eager and SDPA attention apply a window or chunk through the mask alone, never from the attention call's
    keyword, which some families do not pass (Phi-MoE). transformers builds the mask from the config where the
    modeling code calls the builder: for each layer of that type in `layer_types`, or for every layer of a
    config without `layer_types` (as masking_utils.create_masks_for_generate, which mirrors the modeling files,
    reads them). A model whose code never calls it (Llama, whatever stray `sliding_window` its config holds):
    none."""
    builder, key = MASK_BUILDERS[layer_type]
    size = getattr(cfg, key, None)
    if not size or not calls_mask_builder(model, builder):
        return ()
    layer_types = list(getattr(cfg, "layer_types", None) or [layer_type] * num_layers)
    return tuple(size if t == layer_type else None for t in layer_types)


def calls_mask_builder(model, builder: str) -> bool:
    """Whether the modeling code of any of the model's classes names transformers' mask builder `builder` (Mistral
    picks it by name: `mask_function = create_causal_mask if ... else create_sliding_window_causal_mask`)."""
    return any(_module_names(name, builder) for name in {type(m).__module__ for m in model.modules()})


@functools.cache
def _module_names(module_name: str, builder: str) -> bool:
    """Once per modeling file and builder: reading a file's source parses it whole."""
    import inspect
    import sys

    try:
        return re.search(rf"\b{builder}\b", inspect.getsource(sys.modules[module_name])) is not None
    except (KeyError, OSError, TypeError):
        return False


def layer_indices_per_decoder_layer(model) -> list[set[int]]:
    """For each decoder layer, the `layer_idx` of the modules inside it (its own index where none has one)."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        return [{i} for i in range(text_config(model.config).num_hidden_layers)]
    found = []
    for i, layer in enumerate(layers):
        inner = {
            m.layer_idx
            for m in layer.modules()
            if m is not layer and isinstance(getattr(m, "layer_idx", None), int)
        }
        found.append(inner or {i})
    return found


def inspect_model(model) -> ModelAttention:
    """Refuse a model batchrun cannot compute exactly (UnsupportedModel naming it and why), else what its
    attention layers are and what its stateful layers keep."""
    arch = model.config.model_type
    layers = check_config(model)
    # LongRoPE and dynamic NTK: factors per packed sequence (refused where they cannot be)
    rope = PerSequenceRope.of(model, rope_types(text_config(model.config)))
    # the stand-in for the state slots' step view (a hybrid's stateful modules readied and routed to it)
    prepare_stateful_layers(stateful_modules(model))
    state_probe = StateProbe()
    families.adapt_modules(model)
    probe = ProbeAttention()
    T = 5
    vocab = text_config(model.config).vocab_size
    ids = [(7 * i + 3) % vocab for i in range(T)]
    device = next(model.parameters()).device
    services = AttentionServices(probe, None, None, specs=None, layers=layers)  # specs None: read every call
    step = StepMetadata([T], [T], torch.arange(T, device=device), device)
    meta = AttentionMetadata(services, step, [], views={StateProbe.view_key: state_probe})
    try:
        with torch.inference_mode(), meta.running():
            model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.arange(T, device=device)[None],
                use_cache=False,
                batchrun_attn=meta,
            )
            # what the stateful layers keep (each called again, in pieces)
            states = state_probe.spec(measured=device.type != "meta")
    except UnsupportedModel as e:
        raise refusal(arch, str(e)) from None
    except Exception as e:  # noqa: BLE001 - any failure of the model's own code under batchrun's attention
        if not_the_models_fault(e):
            raise  # out of memory, I/O: the run failed (exit 1), the model is not the reason
        raise refusal(
            arch, f"its forward fails under batchrun's attention ({type(e).__name__}: {e})"
        ) from None
    calls = probe.calls
    decoder_layers = layer_indices_per_decoder_layer(model)
    expected = len(decoder_layers)
    layer_types = list(getattr(text_config(model.config), "layer_types", None) or [])
    feed_forward = {i for i, t in enumerate(layer_types) if t in FEED_FORWARD_LAYER_TYPES}
    # a decoder layer is covered when one of its modules attended or kept a state (LongCat-Flash's layers hold
    # two attention sublayers, indices 2i and 2i + 1), or it is a feed-forward layer alone
    seen = set(calls).union(states.layer_indices if states else ())
    silent = [i for i, inner in enumerate(decoder_layers) if not inner & seen and i not in feed_forward]
    if not calls and states is None:
        raise refusal(
            arch,
            "its attention does not go through transformers' attention interface (the layers never called "
            "batchrun's attention function)",
        )
    if silent:
        raise refusal(
            arch,
            f"layers {', '.join(map(str, silent))} of {expected} never call the attention interface nor keep a "
            "state through transformers' cache interface (layers of another kind, or attention computed by the "
            "model's own code)",
        )
    if not calls:
        raise refusal(
            arch, "it has no attention layer (a model of stateful layers alone is not supported yet)"
        )
    query_heads = {c[0] for c in calls.values()}
    if len(query_heads) > 1:
        raise refusal(arch, f"its attention layers differ in query heads: {sorted(query_heads)}")
    (num_heads,) = query_heads
    for num_kv_heads in sorted({c[1] for c in calls.values()}):
        if num_heads % num_kv_heads:
            raise refusal(arch, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    num_layers = max(expected, 1 + max(seen))  # attention and state indices may outnumber decoder layers
    layer_kv, layer_calls = [None] * num_layers, [None] * num_layers
    for i, (_, num_kv_heads, head_dim, v_head_dim, call) in calls.items():
        layer_kv[i] = (call.kind, KVShape(num_kv_heads, head_dim, v_head_dim))
        layer_calls[i] = call
    return ModelAttention(
        architecture=arch,
        layers=layers,
        num_layers=num_layers,
        num_heads=num_heads,
        layer_kv=tuple(layer_kv),
        calls=tuple(layer_calls),
        kv_reads=kv_reads(probe, layer_kv),
        states=states,
        rope=rope,
    )


def kv_reads(probe: ProbeAttention, layer_kv: list) -> tuple[tuple[int, int], ...]:
    """The layers given the very K/V tensors of an earlier layer of their kind and shape (Gemma 3n's and 4's
    KV-shared layers): they attend over that layer's pages, and keep none of their own. The probe holds every
    layer's K/V, so equal addresses are the same tensor, never a freed one's memory reused."""
    first: dict[tuple, int] = {}
    reads = []
    for layer in sorted(probe.kv):
        k, v = probe.kv[layer]
        source = first.setdefault((_place(k), _place(v)), layer)
        if source != layer and layer_kv[source] == layer_kv[layer]:
            reads.append((layer, source))
    return tuple(reads)


def _place(t: torch.Tensor) -> tuple:
    """Where a tensor's elements are: its storage (the storage object's own address, which a meta-device tensor,
    whose data pointer is 0, has too), offset, shape and strides."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride())
