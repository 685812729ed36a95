"""What batchrun learns of a model's attention at load, and the models it refuses there.

batchrun runs the stock `transformers` model code and replaces only its attention function. That computes what
the model computes when (a) every layer's attention goes through transformers' attention interface, passing on
the step's keyword arguments, (b) every argument of those calls is one batchrun honours (attention.layer_call),
and (c) no layer keeps state of its own from one step to the next (a recurrent, convolution or state-space
layer would need a per-sequence state cache beside the pages, which batchrun does not have). A model that fails
any of these is refused here, naming the architecture and the reason, before any row runs: never a row error
later, never a silent difference.

`inspect_model` checks the config first (encoder-decoder models, layer types that are not attention, stateful
modules), then runs a probe: one forward of a few tokens through the very attention function the engine uses,
with a backend that records each layer's call. The probe also yields the facts the engine sizes its pages from:
the K and V shapes the layers actually produce (MLA models have wider keys than values), and the mask kinds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .attention import (
    AttentionMetadata,
    AttentionServices,
    LayerCall,
    MaskKind,
    StepLayout,
    UnsupportedModel,
    attend,
    int_tensor,
)
from .kv_cache import KVCacheShape

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# modules that carry a state from one step to the next (linear attention, convolutions, state-space mixers)
STATEFUL_MODULE = re.compile(r"Mamba|DeltaNet|ShortConv|LinearAttention|Rwkv|RWKV|xLSTM|Recurrent")


@dataclass(frozen=True)
class QueryScaleFix:
    """Llama 4's attention temperature tuning (its NoRoPE layers) scales the queries by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 of the position p, but takes p as the token's index in
    the row: right for one sequence per row, wrong for batchrun's packed row. `factor` turns the scale it applied
    into the one of each token's true position."""

    floor_scale: float
    attn_scale: float

    def _scale(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def factor(self, positions: list[int]) -> torch.Tensor:
        """[T]: true scale / applied scale of each packed token."""
        return self._scale(torch.tensor(positions)) / self._scale(torch.arange(len(positions)))


@dataclass(frozen=True)
class ModelLayers:
    """Per layer, what the calls do not say: the chunk of chunked-attention layers (Llama 4 marks them only in
    the config's `layer_types`), and a query-scale fix."""

    chunks: tuple[int | None, ...] = ()
    scale_fixes: tuple[QueryScaleFix | None, ...] = ()

    def chunk(self, layer: int) -> int | None:
        return self.chunks[layer] if layer < len(self.chunks) else None

    def query_scale_fix(self, layer: int) -> QueryScaleFix | None:
        return self.scale_fixes[layer] if layer < len(self.scale_fixes) else None


@dataclass(frozen=True)
class KVGroups:
    """The layers in KV cache groups: one mask kind per group, every group of the same number of layers, so a
    page (P tokens of one group's layers) is one size for all and every group draws from one pool. A model whose
    layers all attend alike is one group of all its layers: the plain paged cache. Gemma 3's 5 sliding : 1 full
    over 6 layers is 6 groups of 1 layer; gpt-oss's alternating 12 : 12, 2 groups of 12."""

    kinds: tuple[MaskKind, ...]  # per group
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its place among its group's layers (the pool's first axis)
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    @classmethod
    def of_layers(cls, layer_kinds: list[MaskKind]) -> KVGroups:
        by_kind: dict[MaskKind, list[int]] = {}
        for layer, kind in enumerate(layer_kinds):
            by_kind.setdefault(kind, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_kind.values()))
        kinds, layer_group, layer_slot = [], [0] * len(layer_kinds), [0] * len(layer_kinds)
        for kind, layers in by_kind.items():
            for i in range(0, len(layers), size):
                for slot, layer in enumerate(layers[i : i + size]):
                    layer_group[layer], layer_slot[layer] = len(kinds), slot
                kinds.append(kind)
        return cls(tuple(kinds), tuple(layer_group), tuple(layer_slot), size)


@dataclass(frozen=True)
class ModelAttention:
    """What the probe found: the layers' K/V shapes, the mask kinds they use, and the per-layer facts."""

    architecture: str
    layers: ModelLayers
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    layer_kinds: tuple[MaskKind, ...]  # per layer

    @property
    def groups(self) -> KVGroups:
        return KVGroups.of_layers(list(self.layer_kinds))

    def kv_shape(self, page_size: int, dtype: torch.dtype) -> KVCacheShape:
        """The shape of one page: P tokens of one KV cache group's layers."""
        v_dim = self.v_head_dim if self.v_head_dim != self.head_dim else None
        layers = self.groups.layers_per_group
        return KVCacheShape(layers, self.num_kv_heads, self.head_dim, page_size, dtype, v_dim)


class ProbeAttention:
    """The probe's backend: records each layer's call and attends over the probe's own tokens (no pages)."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: dict[int, tuple] = {}

    def prepare(self, layout: StepLayout, kind: MaskKind) -> None:
        return None

    def forward(self, meta: AttentionMetadata, layer: int, call: LayerCall, q, k, v, scale: float):
        self.calls[layer] = (q.shape[1], k.shape[1], k.shape[2], v.shape[2], call)
        pos = torch.arange(q.shape[0], device=q.device)
        heads_first = lambda x: x.transpose(0, 1)[None]
        mask = call.kind.visible(pos, pos)[None, None]
        return attend(heads_first(q), heads_first(k), heads_first(v), mask, scale, call)[0].transpose(0, 1)


def refusal(architecture: str, reason: str) -> UnsupportedModel:
    return UnsupportedModel(f"model {architecture!r} cannot run on batchrun: {reason}")


def check_config(model) -> ModelLayers:
    """The config's and the modules' verdict, before any forward; the per-layer facts they give."""
    cfg = model.config
    arch = cfg.model_type
    if getattr(cfg, "is_encoder_decoder", False):
        raise refusal(arch, "an encoder-decoder model; batchrun runs decoder-only causal language models")
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    other = {
        t: [i for i, x in enumerate(layer_types) if x == t]
        for t in layer_types
        if t not in ATTENTION_LAYER_TYPES
    }
    if other:
        kinds = "; ".join(f"layers {', '.join(map(str, idx))} are `{t}`" for t, idx in other.items())
        raise refusal(
            arch,
            f"{kinds}: layers that keep a recurrent, convolution or state-space state per sequence, which "
            "batchrun does not cache (it pages attention's K/V only); such hybrids are refused rather than run "
            "wrong",
        )
    stateful = sorted({type(m).__name__ for m in model.modules() if STATEFUL_MODULE.search(type(m).__name__)})
    if stateful:
        raise refusal(
            arch,
            f"its modules {', '.join(stateful)} keep a state per sequence between steps, which batchrun does not "
            "cache (it pages attention's K/V only)",
        )
    chunk_size = getattr(cfg, "attention_chunk_size", None)
    chunks = tuple(chunk_size if t == "chunked_attention" else None for t in layer_types)
    if any(t == "chunked_attention" for t in layer_types) and not chunk_size:
        raise refusal(arch, "chunked-attention layers without `attention_chunk_size` in the config")
    fixes: dict[int, QueryScaleFix] = {}
    for m in model.modules():
        if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
            fixes[m.layer_idx] = QueryScaleFix(float(m.floor_scale), float(m.attn_scale))
    num_layers = max([len(layer_types), *[i + 1 for i in fixes]])
    scale_fixes = tuple(fixes.get(i) for i in range(num_layers)) if fixes else ()
    return ModelLayers(chunks, scale_fixes)


def num_decoder_layers(model) -> int:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    return len(layers) if layers is not None else model.config.num_hidden_layers


def inspect_model(model) -> ModelAttention:
    """Refuse a model batchrun cannot compute exactly (UnsupportedModel naming it and why), else what its
    attention layers are."""
    arch = model.config.model_type
    layers = check_config(model)
    probe = ProbeAttention()
    T = 5
    vocab = model.config.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(T)]
    layout = StepLayout([T], [T], [[0]], int_tensor(list(range(T))))
    meta = AttentionMetadata(AttentionServices(probe, None, None, layers), [layout], list(range(T)))
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.arange(T, device=device)[None],
                use_cache=False,
                batchrun_attn=meta,
            )
    except UnsupportedModel as e:
        raise refusal(arch, str(e)) from None
    except Exception as e:  # noqa: BLE001 - any failure of the model's own code under batchrun's attention
        raise refusal(
            arch, f"its forward fails under batchrun's attention ({type(e).__name__}: {e})"
        ) from None
    calls = probe.calls
    if not calls:
        raise refusal(
            arch,
            "its attention does not go through transformers' attention interface (the layers never called "
            "batchrun's attention function)",
        )
    expected = num_decoder_layers(model)
    if sorted(calls) != list(range(expected)):
        missing = sorted(set(range(expected)) - set(calls))
        raise refusal(
            arch,
            f"layers {', '.join(map(str, missing))} of {expected} never call the attention interface (layers of "
            "another kind, or attention computed by the model's own code)",
        )
    shapes = {c[:4] for c in calls.values()}
    if len(shapes) > 1:
        raise refusal(
            arch, f"its layers differ in attention shape (heads, KV heads, K dim, V dim): {sorted(shapes)}"
        )
    ((num_heads, num_kv_heads, head_dim, v_head_dim),) = shapes
    if num_heads % num_kv_heads:
        raise refusal(arch, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    layer_calls = [calls[i][4] for i in range(expected)]
    return ModelAttention(
        architecture=arch,
        layers=layers,
        num_layers=expected,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        layer_kinds=tuple(c.kind for c in layer_calls),
    )
