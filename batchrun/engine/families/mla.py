"""MLA (multi-head latent attention: DeepSeek-V2/V3, Kimi K2, ...): keys wider than values.

Why: transformers decompresses the latent before it calls the attention interface, so each layer hands batchrun
keys of the nope + rope dims and values of `v_head_dim`, with one KV head per query head; the pages hold those
(the probe finds the same shapes at load; this rule sizes them from the config alone, for the memory check made
before the model loads).

Checks: configs with `kv_lora_rank`. Provides: `kv_shape`.
"""

from __future__ import annotations

from .adapter import FamilyAdapter


class MultiHeadLatentAttention(FamilyAdapter):
    name = "MLA's K/V shapes"

    def kv_shape(self, cfg, layer, sliding: bool) -> tuple[int, int, int] | None:
        if not getattr(cfg, "kv_lora_rank", None):
            return None
        return cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim


ADAPTER = MultiHeadLatentAttention()
