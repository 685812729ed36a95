"""A hybrid model's stateful layers at load: which modules keep a state per sequence, and how their calls reach
the step's state slots.

Hybrid models (linear attention, Mamba or short convolutions beside attention) keep a state per sequence in those
layers. A module that keeps it through transformers' cache interface (`get_conv_state` / `update_conv_state` /
`update_recurrent_state`, or MiniMax's `set_linear_cache`) is run by batchrun on a state slot of its own
(state_cache.py): `prepare_stateful_layers` routes its calls through the running step's `StepStates`. A module
that keeps its states in attributes of its own is run alike where a family adapter moves them
(families.recurrent_gemma_states); one that keeps a state any other way is refused (`stateful_modules`), since it
would silently start afresh at every step. The load probe (architecture.inspect_model) calls these first, then
records what the modules keep (state_cache.StateProbe).
"""

from __future__ import annotations

import functools
import re

import torch

from batchrun.engine.attention import AttentionMetadata, UnsupportedModel, refusal
from batchrun.engine.model import families
from batchrun.engine.model.state_cache import StateCache, StatefulCall
from batchrun.engine.model.structure import decoder_of

# how a module keeps a state through transformers' cache interface: the calls of it in its source (a family's
# own names for them included)
CACHE_INTERFACE = re.compile(
    "|".join(
        re.escape(f".{call}(")
        for call in ("update_conv_state", "update_recurrent_state", *families.cache_interface_calls())
    )
)


def uses_cache_interface(module: torch.nn.Module) -> bool:
    """The module's class keeps its state through transformers' cache interface (its source calls it)."""
    return _class_uses_cache_interface(type(module))


@functools.cache
def _class_uses_cache_interface(cls: type) -> bool:
    """Once per class: reading a class's source parses its whole file, for every module of a model uncached."""
    import inspect

    try:
        return bool(CACHE_INTERFACE.search(inspect.getsource(cls)))
    except (OSError, TypeError):
        return False


def stateful_modules(model) -> list[torch.nn.Module]:
    """The modules that keep a state per sequence; UnsupportedModel for one that keeps it outside transformers'
    cache interface and the attributes a family adapter moves (batchrun could not give it a slot)."""
    arch = model.config.model_type
    found, other = [], set()
    for m in model.modules():
        name = type(m).__name__
        own_states = families.keeps_own_states(m)
        if own_states and not isinstance(getattr(m, "layer_idx", None), int):
            m.layer_idx = _decoder_layer_of(model, m)  # RecurrentGemma's block keeps no index of its own
        if uses_cache_interface(m) or own_states:
            if not isinstance(getattr(m, "layer_idx", None), int):
                raise refusal(arch, f"its stateful module {name} has no `layer_idx`")
            found.append(m)
        elif families.looks_stateful(model, m) and not any(uses_cache_interface(c) for c in m.modules()):
            other.add(type(m).__name__)
    if other:
        raise refusal(
            arch,
            f"its modules {', '.join(sorted(other))} keep a state per sequence outside transformers' "
            "linear-attention cache interface (get_conv_state / update_recurrent_state), so batchrun cannot keep "
            "it in a state slot",
        )
    return found


def _decoder_layer_of(model, module: torch.nn.Module) -> int:
    """The index of the decoder layer that holds `module`."""
    for i, layer in enumerate(decoder_of(model).layers):
        if any(m is module for m in layer.modules()):
            return i
    raise refusal(
        model.config.model_type, f"its stateful module {type(module).__name__} is in no decoder layer"
    )


def prepare_stateful_layers(modules: list[torch.nn.Module]) -> None:
    """Route each stateful module's calls through the running step's states (AttentionMetadata.running): its own
    forward then runs on a cache over the sequences' slots. Idempotent; only this model's instances change."""
    import inspect

    for m in modules:
        if "_batchrun_call" in m.__dict__:
            continue
        own = families.stateful_forward(m)  # a module keeping its states in attributes of its own
        if own is not None:
            m._batchrun_call = StatefulCall(own, "cache", ())
            m.forward = _stateful_forward.__get__(m)
            continue
        params = inspect.signature(m.forward).parameters
        keyword = next((k for k in ("cache", "cache_params", "past_key_values") if k in params), None)
        if keyword is None:
            raise refusal(
                m.config.model_type if hasattr(m, "config") else type(m).__name__,
                f"{type(m).__name__} takes no cache argument",
            )
        m._batchrun_call = StatefulCall(m.forward, keyword, tuple(params)[1:])
        m.forward = _stateful_forward.__get__(m)


def _stateful_forward(self, hidden_states=None, *args, **kwargs):
    """A stateful module's forward under batchrun: its own code, on the step's state slots."""
    kwargs.pop("batchrun_attn", None)
    meta = AttentionMetadata.current()
    states = meta.views.get(StateCache) if meta is not None else None
    if states is None:
        raise UnsupportedModel(
            f"{type(self).__name__} (layer {self.layer_idx}) was called outside a batchrun step"
        )
    call: StatefulCall = self._batchrun_call
    if len(args) > len(call.positional):
        raise UnsupportedModel(
            f"{type(self).__name__} is called with positional arguments batchrun cannot split"
        )
    kwargs.update(zip(call.positional, args))  # by name: the per-token ones are cut per sequence
    for name in ("cache", "cache_params", "past_key_values", "cache_position"):
        kwargs.pop(name, None)  # the slots are the cache
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None  # a sequence's rows have no padding to mask
    if hidden_states is None:
        hidden_states = kwargs.pop("hidden_states")
    return states.run(self, call, hidden_states, kwargs)
