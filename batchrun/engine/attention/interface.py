"""The one function `transformers` calls for every attention layer, of a generation engine and of a pooling
runner alike, registered as `attn_implementation="batchrun"`.

transformers calls it once per layer with q [1, Hq, T, D] and k/v [1, Hkv, T, D] after RoPE, and the step's
metadata as the `batchrun_attn` keyword: a generation step's `AttentionMetadata` (attention over the KV pages,
through the engine's backend) or a pooling step's `PackedLayout` (packed.py: the texts of one packed row, each
attending to itself, no K/V kept: vLLM's ENCODER_ONLY attention). Every other argument is read here, for both
(`read_call`): honoured, known not to matter, or refused (`UnsupportedModel`), never ignored; which keys a query
sees is the call's `MaskKind`, causal or not. The load probe (architecture.inspect_model, for both) reads each
layer's call in full once; afterwards a paged call that passes the same keywords as at the probe runs on the
layer's frozen `LayerSpec`, and one that does not is read again and refused if it asks for anything else. A
packed call is frozen the same way, by the pooling load's own probe forward (a packed row's calls carry no
chunk, which the generation probe reads from the model's layers).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from batchrun.engine.attention.layers import (
    CallSignature,
    LayerCall,
    LayerSpec,
    RelativeBias,
    TokenScores,
    UnsupportedModel,
)
from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.attention.metadata import AttentionMetadata
from batchrun.engine.attention.packed import PackedLayout, attend_packed

ATTENTION_NAME = "batchrun"
METADATA_KEYWORD = "batchrun_attn"  # the keyword the step's metadata rides in, through the model's forward

# Keyword arguments that do not change what attention computes here: positions are already in q/k (RoPE); the
# segments (token_type_ids) are in the embeddings; the rest steer caching, outputs or a flash-attention kernel
# (its determinism, its variable-length hints: batchrun knows each sequence's bounds itself).
NEUTRAL_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "token_type_ids",
        "deterministic",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)
# arguments that set what a layer computes, the same at every call (read into its LayerCall)
LAYER_CONSTANTS = ("sliding_window", "softcap", "s_aux", "alibi_slopes", "is_causal")
# arguments computed from each query token's hidden state (TokenScores), read at every call
TOKEN_TERMS = ("position_bias", "sinks")


def read_call(
    module: torch.nn.Module, layer: int, attention_mask, dropout: float, kwargs: dict, layers, query_shape
) -> LayerCall:
    """The layer's call checked and read: every argument is honoured or known not to matter, else
    UnsupportedModel naming it. `layers`: architecture.ModelLayers (each layer's chunk, and the window of its
    mask, which HF applies whether the call passes it or not; None: a pooling step's call); `query_shape`:
    [1, Hq, T, D]. Causal or not as transformers' own SDPA reads it: the call's `is_causal`, else the module's,
    else causal."""
    where = f"{type(module).__name__} (layer {layer})"
    if attention_mask is not None:
        raise UnsupportedModel(
            f"{where} passes an attention mask of its own; batchrun builds each sequence's mask itself and "
            "cannot honour another"
        )
    if dropout:
        raise UnsupportedModel(
            f"{where} asks for attention dropout {dropout} (the model is not in eval mode?)"
        )
    scores = token_scores(where, kwargs, query_shape)
    for name, value in kwargs.items():
        if name in NEUTRAL_KWARGS or name in LAYER_CONSTANTS:
            continue
        if scores is not None and name in TOKEN_TERMS:
            continue
        if value is None or value is False:
            continue
        raise UnsupportedModel(
            f"{where} passes the attention argument `{name}`, which batchrun's paged attention does not "
            "implement; it is refused rather than ignored"
        )
    window = kwargs.get("sliding_window")
    chunk = layers.chunk(layer) if layers is not None else None
    masked = layers.window(layer) if layers is not None else None  # the window of the model's own mask
    if window is None:
        window = masked  # HF's attention applies a window through the mask alone (Phi-MoE passes none)
    elif masked is not None and masked != window:
        raise UnsupportedModel(
            f"{where} passes the attention argument `sliding_window` {window}, but the model's mask applies a "
            f"window of {masked} (the config's `sliding_window`)"
        )
    if window is not None and chunk is not None:
        raise UnsupportedModel(f"{where} asks for both a sliding window and chunked attention")
    slopes = kwargs.get("alibi_slopes")
    if slopes is not None and tuple(slopes.shape) != (query_shape[1],):
        raise UnsupportedModel(
            f"{where} passes `alibi_slopes` of shape {tuple(slopes.shape)}, not one slope per query head"
        )
    signature = CallSignature(
        frozenset(name for name, value in kwargs.items() if value is not None and value is not False),
        tuple((name, kwargs[name]) for name in LAYER_CONSTANTS if name in kwargs),
    )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    kind = MaskKind(int(window) if window else None, chunk, bool(causal))
    return LayerCall(kind, kwargs.get("softcap") or None, kwargs.get("s_aux"), slopes, scores, signature)


def token_scores(where: str, kwargs: dict, query_shape) -> TokenScores | None:
    """Inkling 2's per-token terms: `sinks` [1, Hq, T, 1] (a logit per query token and head, from its hidden
    state) and `position_bias` as batchrun's adapter of its bias module gives it (RelativeBias). A bias tensor
    of another form is over the packed row's indices, not the tokens' positions: not taken."""
    bias, sinks = kwargs.get("position_bias"), kwargs.get("sinks")
    if bias is None and sinks is None:
        return None
    _, num_heads, num_tokens, _ = query_shape
    if bias is not None and not isinstance(bias, RelativeBias):
        raise UnsupportedModel(
            f"{where} passes a `position_bias` of its own ({type(bias).__name__}), made over the packed row "
            "rather than each sequence's positions; batchrun takes only a relative bias module it knows "
            "(families.inkling_relative_bias)"
        )
    if sinks is not None and tuple(sinks.shape) != (1, num_heads, num_tokens, 1):
        raise UnsupportedModel(
            f"{where} passes `sinks` of shape {tuple(sinks.shape)}, not one logit per head and query token"
        )
    return TokenScores(
        relative_bias=None if bias is None else bias.logits[0].transpose(0, 1),  # [T, Hq, R]
        sinks=None if sinks is None else sinks[0, :, :, 0].transpose(0, 1),  # [T, Hq]
    )


def _layer_call(meta: AttentionMetadata, module, layer: int, attention_mask, dropout, kwargs, query_shape):
    """This call's LayerSpec and LayerCall: the spec's own where the call matches the probe's (the common
    case: a few dictionary lookups); read in full for the probe, and for a call that differs, which is refused
    unless it asks for exactly what the spec computes."""
    services = meta.services
    if services.specs is None:  # the load probe
        call = read_call(module, layer, attention_mask, dropout, kwargs, services.layers, query_shape)
        return LayerSpec(layer, -1, True, call, call.token_scores is not None), call
    spec = services.specs[layer] if layer < len(services.specs) else None
    if spec is None:
        raise UnsupportedModel(f"{type(module).__name__} (layer {layer}) attended, but did not at load")
    if spec.matches(attention_mask, dropout, kwargs):
        if not spec.token_terms:
            return spec, spec.call
        where = f"{type(module).__name__} (layer {layer})"
        return spec, dataclasses.replace(spec.call, token_scores=token_scores(where, kwargs, query_shape))
    call = read_call(module, layer, attention_mask, dropout, kwargs, services.layers, query_shape)
    frozen = spec.call
    if (
        call.kind,
        call.softcap,
        call.sinks is None,
        call.alibi_slopes is None,
        call.token_scores is None,
    ) != (
        frozen.kind,
        frozen.softcap,
        frozen.sinks is None,
        frozen.alibi_slopes is None,
        not spec.token_terms,
    ):
        raise UnsupportedModel(
            f"{type(module).__name__} (layer {layer}) asks for other attention than at load ({call} against "
            f"{frozen}); its pages and plans were made for the first"
        )
    return spec, call


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function `transformers` calls for every attention layer; returns [1, T, Hq, Dv]: paged for a
    generation step, packed for a pooling step. A module that attends over something other than the sequence's
    tokens runs its model's own eager attention (a family adapter marks it at load:
    families.inkling_own_attention)."""
    own = getattr(module, "_batchrun_own_attention", None)
    if own is not None:
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    meta = kwargs.pop(METADATA_KEYWORD, None)
    if meta is None:
        raise UnsupportedModel(
            f"{type(module).__name__}: its attention does not pass batchrun's step metadata (the model's code "
            "calls the attention function without the keyword arguments it was given)"
        )
    if isinstance(meta, PackedLayout):
        return packed_forward(meta, module, query, key, value, attention_mask, scaling, dropout, kwargs), None
    return paged_forward(meta, module, query, key, value, attention_mask, scaling, dropout, kwargs), None


def packed_forward(layout: PackedLayout, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A pooling step's layer, attended over the packed row (packed.py), which computes a plain SDPA under the
    call's mask kind. A call that passes the keywords the load's probe saw runs on the layer's frozen spec;
    any other is read in full (read_call) and refused if it asks for anything else, never ignored."""
    layer = layout.calls  # a pooling model's layers attend in order, once each per forward
    specs = layout.specs
    spec = specs[layer] if specs is not None and layer < len(specs) else None
    if spec is not None and spec.matches(attention_mask, dropout, kwargs):
        return attend_packed(layout, spec.kind, query, key, value, scaling)
    call = read_call(module, layer, attention_mask, dropout, kwargs, None, query.shape)
    if not call.plain:
        asks = [
            name
            for name, value in (
                ("soft-capping", call.softcap),
                ("sinks", call.sinks),
                ("ALiBi", call.alibi_slopes),
                ("per-token terms", call.token_scores),
            )
            if value is not None
        ]
        raise UnsupportedModel(
            f"{type(module).__name__} (layer {layer}) asks for {', '.join(asks)}, which batchrun's packed "
            "attention (pooling) does not compute"
        )
    if specs is None:  # the load's probe: the call frozen for every later step
        layout.probed.append(LayerSpec(layer, -1, False, call))
    elif spec is None or call.kind != spec.kind:
        raise UnsupportedModel(
            f"{type(module).__name__} (layer {layer}) asks for other attention than at load ({call} against "
            f"{spec.call if spec else 'no call'})"
        )
    return attend_packed(layout, call.kind, query, key, value, scaling)


def paged_forward(
    meta: AttentionMetadata, module, query, key, value, attention_mask, scaling, dropout, kwargs
):
    """A generation step's layer: its K/V written to their pages and attended through the block tables by the
    engine's backend (the probe's recording backend at load)."""
    t0 = time.perf_counter()
    layer = meta.layer_index(module)
    spec, call = _layer_call(meta, module, layer, attention_mask, dropout, kwargs, query.shape)
    assert query.shape[0] == 1, "batchrun packs every sequence into one row"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = tokens_first(query), tokens_first(key), tokens_first(value)  # [T, H, D]
    if spec.scale_fix is not None:
        q = q * meta.query_scales[spec.scale_fix]
    out = meta.services.backend.forward(meta, spec, call, q, k, v, scale)
    times = meta.services.times
    if times is not None:
        times.add("attention", time.perf_counter() - t0)
    return out[None]


def tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] as [T, H, D]: `x[0].transpose(0, 1)`'s view made as one operation rather than two (each
    layer does it for q, k and v, every step)."""
    return x.as_strided((x.shape[2], x.shape[1], x.shape[3]), (x.stride(2), x.stride(1), x.stride(3)))


def register(function=attention_forward) -> None:
    """Make `attn_implementation="batchrun"` known to transformers (idempotent, no global patching);
    `function`: another in its place (bench/host.py counts the operations inside it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, function)
