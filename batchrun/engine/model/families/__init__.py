"""Family rules: what particular model families compute around their attention, states, pages or images that
batchrun must adapt to, one adapter per quirk, each in a module of its own that says why the quirk exists, what
the adapter checks at load and which hooks it provides (adapter.FamilyAdapter lists the hooks and who calls them).

The engine asks this registry, never a family's name (tests/test_family_adapters.py holds the rest of the
package to that): the functions below ask every adapter that applies to the model (`adapters_for`) and combine
their answers. Every module here that declares an `ADAPTER` is registered, so adding a family's rule is adding
its module and its test. A family none of them covers runs on transformers' code as it is, or is refused at load
with the reason (architecture.py, image_refusal below), never computed by another family's rule.

What is found by structure rather than by a family's name stays with its mechanism: Zamba 2's shared attention
block (an attention module without a `layer_idx` is a layer of its own at each call: architecture.ModelLayers),
KV-shared layers at load (the probe sees the same K/V tensors: architecture.kv_reads), a vision-language
wrapper's own attention (loading.attention_implementation asks its class whether it takes SDPA).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch

from batchrun.engine.model.families.adapter import IMAGE_ATTENTION, IMAGE_POSITIONS, FamilyAdapter
from batchrun.engine.model.families.gemma_image_blocks import ImageBlocks, bidirectional_attention
from batchrun.engine.model.families.llama4_query_scale import QueryScaleFix
from batchrun.engine.model.families.qwen_mrope import MRope

__all__ = ["ADAPTERS", "FamilyAdapter", "ImageBlocks", "MRope", "QueryScaleFix", "adapters_for"]


def _registered() -> tuple[FamilyAdapter, ...]:
    """The `ADAPTER` of every module of this package that declares one, in module name order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        adapter = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ADAPTER", None)
        if adapter is not None:
            found.append(adapter)
    return tuple(found)


ADAPTERS: tuple[FamilyAdapter, ...] = _registered()


def adapters_for(model_or_config) -> tuple[FamilyAdapter, ...]:
    """The adapters that apply to a model (or a config): those of its `model_type`, and those that look for
    what they concern in every model."""
    config = model_or_config.config if isinstance(model_or_config, torch.nn.Module) else model_or_config
    return tuple(a for a in ADAPTERS if a.applies(config))


def _first(answers):
    return next((a for a in answers if a is not None), None)


# ---- at load (architecture.py) ----
def refusal(model) -> str | None:
    """Why an adapter refuses the model at load, or None."""
    return _first(a.refusal(model) for a in adapters_for(model))


def query_scale_fixes(model) -> dict[int, QueryScaleFix]:
    """Layer -> its query-scale fix."""
    return {layer: fix for a in adapters_for(model) for layer, fix in a.query_scale_fixes(model).items()}


def adapt_modules(model) -> None:
    """Install the adapters' changes on the model's module instances (before the probe; idempotent)."""
    for a in adapters_for(model):
        a.adapt_modules(model)


def looks_stateful(model, module) -> bool:
    return any(a.looks_stateful(model, module) for a in adapters_for(model))


# module hooks are asked of every adapter: the module's class is what matches
def keeps_own_states(module) -> bool:
    return any(a.keeps_own_states(module) for a in ADAPTERS)


def stateful_forward(module):
    return _first(a.stateful_forward(module) for a in ADAPTERS)


def cache_methods() -> dict:
    return {name: f for a in ADAPTERS for name, f in a.cache_methods().items()}


def cache_interface_calls() -> tuple[str, ...]:
    return tuple(call for a in ADAPTERS for call in a.cache_interface_calls())


# ---- images (engine.py, multimodal.py, loading.py) ----
def image_positions(model) -> MRope | None:
    return _first(a.image_positions(model) for a in adapters_for(model))


def image_blocks(model) -> ImageBlocks | None:
    return _first(a.image_blocks(model) for a in adapters_for(model))


def extra_feature_streams(model) -> int:
    return sum(a.extra_feature_streams(model) for a in adapters_for(model))


def feature_streams(output) -> list[list]:
    """The further streams of an image encoder's output (asked of every adapter: the output is what matches)."""
    return [stream for a in ADAPTERS for stream in a.feature_streams(output)]


def with_feature_streams(model, output, streams: list) -> None:
    for a in adapters_for(model):
        n = a.extra_feature_streams(model)
        a.with_feature_streams(output, streams[:n])
        streams = streams[n:]


def video_stand_in(config) -> dict:
    return {k: v for a in adapters_for(config) for k, v in a.video_stand_in(config).items()}


def image_refusal(model) -> str | None:
    """Why the model's image tokens are more than batchrun computes, or None: tokens attending to later ones
    beyond one image's, or positions or token types of its own where no adapter writes them down for its
    family (the message names the families that have one)."""
    if bidirectional_attention(model.config) and image_blocks(model) is None:  # beyond one image's tokens
        return (
            "its tokens attend to later ones (use_bidirectional_attention), which batchrun does not compute"
        )
    if any(a.image_rule for a in adapters_for(model) if a.model_types):
        return None
    if MRope.find_owner(model) is not None:
        return (
            "its image tokens take 3-D rotary positions of its own family (get_rope_index), which batchrun "
            f"computes for {_families_with(IMAGE_POSITIONS)} only"
        )
    params = inspect.signature(model.forward).parameters
    typed = [name for name in ("token_type_ids", "mm_token_type_ids") if name in params]
    if typed:
        return (
            f"its token types (`{typed[0]}`) steer its image attention, which batchrun computes for "
            f"{_families_with(IMAGE_ATTENTION)} only"
        )
    return None


def _families_with(rule: str) -> str:
    return ", ".join(sorted(t for a in ADAPTERS if a.image_rule == rule for t in a.model_types))
