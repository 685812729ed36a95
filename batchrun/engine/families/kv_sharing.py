"""KV-shared layers (Gemma 3n, Gemma 4): a "reuse" layer attends over the K/V of its type's "store" layer.

Why: such a layer computes no K/V of its own and keeps no pages: it reads the place of the layer it shares with.
The probe finds these at load (a layer handed the very K/V tensors of an earlier one); this rule reads them from
the config's `kv_sharing_modes`, for the memory check made before the model loads.

Checks: configs with `kv_sharing_modes`. Provides: `kv_sources`.
"""

from __future__ import annotations

from .adapter import FamilyAdapter


class KVSharing(FamilyAdapter):
    name = "KV-shared layers"

    def kv_sources(self, cfg) -> dict[int, int]:
        modes = getattr(cfg, "kv_sharing_modes", None) or []
        types = list(getattr(cfg, "layer_types", None) or [])
        stores = {types[i]: i for i, m in enumerate(modes) if m == "store"}
        return {i: stores[types[i]] for i, m in enumerate(modes) if m == "reuse" and types[i] in stores}


ADAPTER = KVSharing()
