"""MiniMax's lightning attention names transformers' cache interface its own way.

Why: it keeps its one recurrent state through its own cache class's `get_linear_cache` / `set_linear_cache`
rather than `get_recurrent_state` / `update_recurrent_state`. The state slots' cache answers to both names
(state_cache), and the load recognises a module whose source calls `set_linear_cache` as one that keeps its state
through the cache (stateful_layers.uses_cache_interface), so it gets a state slot.

Checks at load: module sources calling `.set_linear_cache(`. Provides: `cache_methods`, `cache_interface_calls`.
"""

from __future__ import annotations

from batchrun.engine.model.families.adapter import FamilyAdapter


class MiniMaxLinearCache(FamilyAdapter):
    name = "MiniMax's linear cache"

    def cache_methods(self) -> dict:
        return {"get_linear_cache": _get_linear_cache, "set_linear_cache": _set_linear_cache}

    def cache_interface_calls(self) -> tuple[str, ...]:
        return ("set_linear_cache",)


def _get_linear_cache(self, layer_idx: int):
    return self.get_recurrent_state(layer_idx)


def _set_linear_cache(self, layer_idx: int, state) -> None:
    self.update_recurrent_state(state, layer_idx)
    self.layers[layer_idx].has_previous_state[0] = True


ADAPTER = MiniMaxLinearCache()
