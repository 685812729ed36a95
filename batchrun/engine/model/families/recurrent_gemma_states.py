"""RecurrentGemma's recurrent block keeps its states in attributes of its own.

Why: batchrun keeps a hybrid layer's states in state slots through transformers' cache interface; RecurrentGemma's
block does not use that interface: its convolution window sits in `conv1d_state` and its RG-LRU's state in
`rg_lru.recurrent_states` (`generate` sets them up, and the module replaces them at every call). Around each call
batchrun sets them from the sequences' slots and takes them back (`AttributeStates`), so the module's own code
runs on the slots.

Checks at load: modules of the class `RecurrentGemmaRecurrentBlock` (it has no `layer_idx`: architecture gives it
its decoder layer's). Provides: `keeps_own_states`, `stateful_forward`.
"""

from __future__ import annotations

from typing import Any

import torch

from batchrun.engine.model.families.adapter import FamilyAdapter

# class -> the attributes (dotted paths from the module) of its convolution state, then its recurrent state
ATTRIBUTE_STATES = {"RecurrentGemmaRecurrentBlock": ("conv1d_state", "rg_lru.recurrent_states")}


class RecurrentGemmaStates(FamilyAdapter):
    name = "RecurrentGemma's attribute states"

    def keeps_own_states(self, module) -> bool:
        return type(module).__name__ in ATTRIBUTE_STATES

    def stateful_forward(self, module):
        attributes = ATTRIBUTE_STATES.get(type(module).__name__)
        return None if attributes is None else AttributeStates(module.forward, module, *attributes)


class AttributeStates:
    """A module's forward on a cache layer (state_cache's StatefulCall form): each call sets the attributes from
    the cache layer batchrun hands it (views of the sequences' slots; None for a sequence with no state yet,
    which the module then starts from zeros), runs the module's own forward with its cache on, puts the states it
    left into the layer, and clears the attributes again, so no sequence's state stays behind in the module."""

    def __init__(self, forward, module: torch.nn.Module, conv: str, recurrent: str):
        self.forward = forward  # the module's own
        # (owner, attribute name) of its convolution state, then of its recurrent state
        self.places = [_attribute(module, conv), _attribute(module, recurrent)]
        self.layer_idx = module.layer_idx

    def __call__(self, hidden: torch.Tensor, cache, **kwargs):
        layer = cache.layers[self.layer_idx]
        held = (layer.conv_states, layer.recurrent_states)
        initialized = (layer.is_conv_states_initialized, layer.is_recurrent_states_initialized)
        for (owner, name), states, ready in zip(self.places, held, initialized):
            setattr(owner, name, states[0] if ready[0] and layer.has_previous_state[0] else None)
        try:
            out = self.forward(hidden, **{**kwargs, "use_cache": True})
            for (owner, name), states, ready in zip(self.places, held, initialized):
                states[0], ready[0] = getattr(owner, name), True
        finally:
            for owner, name in self.places:
                setattr(owner, name, None)
        layer.has_previous_state[0] = True
        return out


def _attribute(module: torch.nn.Module, path: str) -> tuple[Any, str]:
    """(the object holding the attribute at a dotted path from module, the attribute's name)."""
    *owners, name = path.split(".")
    for part in owners:
        module = getattr(module, part)
    return module, name


ADAPTER = RecurrentGemmaStates()
