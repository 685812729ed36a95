"""Inkling 2 sizes its sliding-window layers' heads by keys of their own (`swa_head_dim`,
`swa_num_key_value_heads`).

Why: its sliding layers have other head dims and KV heads than its full ones, and its config says so in those
keys rather than in a per-layer config; the memory check made before the model loads sizes the sliding layers'
pages by them (the probe finds the same shapes at load).

Checks: configs with `swa_` keys. Provides: `sliding_kv_keys`.
"""

from __future__ import annotations

from .adapter import FamilyAdapter

KEYS = ("head_dim", "num_key_value_heads")


class InklingSlidingHeads(FamilyAdapter):
    name = "Inkling 2's sliding-layer heads"

    def sliding_kv_keys(self, cfg) -> dict[str, int]:
        return {key: value for key in KEYS if (value := getattr(cfg, f"swa_{key}", None))}


ADAPTER = InklingSlidingHeads()
