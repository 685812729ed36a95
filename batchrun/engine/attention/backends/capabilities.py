"""What a backend declares it computes, and where: the engine asks these, never a backend's name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.attention.layers import LayerSpec


@dataclass(frozen=True)
class Capabilities:
    """What a backend computes beyond paged causal attention, and on what. A layer asking for something its
    backend lacks is refused at load (`lacks`, through `AttentionBackend.supports`), never computed otherwise;
    `image_blocks` alone is asked by the engine, which runs such a model's text on a backend without it and
    refuses its images."""

    devices: tuple[str, ...] | None  # device types it runs on; None: wherever PyTorch runs
    image_blocks: bool  # one image's tokens seeing each other during prefill (families.ImageBlocks)
    windows: bool = True  # a sliding window (MaskKind.window)
    chunks: bool = True  # chunked attention (MaskKind.chunk: Llama 4's local layers)
    softcap: bool = True  # logit soft-capping (Gemma 2)
    sinks: bool = True  # a sink logit per head (gpt-oss)
    alibi: bool = (
        True  # ALiBi: a slope per head times the key's position less the query's (LayerCall.alibi_slopes)
    )
    # each query token's own sink logits and relative bias (layers.TokenScores: Inkling 2), read through
    # `LayerCall`'s helpers: `terms` on an eager path, `sink_logits` / `kernel_sinks` / `relative_bias` in a kernel
    token_terms: bool = True
    unequal_head_dims: bool = True  # keys wider than values (MLA: DeepSeek-V2/V3)
    dtypes: tuple[torch.dtype, ...] | None = None  # of the pages; None: any (or the kernels' own check says)

    def runs_on(self, device: torch.device) -> bool:
        return self.devices is None or device.type in self.devices

    def lacks(self, spec: LayerSpec, head_dim: int, v_head_dim: int) -> str | None:
        """What this layer asks that the backend does not compute (None: nothing); `head_dim`, `v_head_dim`:
        its KV cache group's."""
        call = spec.call
        asked = (
            (call.kind.window is not None and not self.windows, f"a sliding window of {call.kind.window}"),
            (call.kind.chunk is not None and not self.chunks, f"chunked attention of {call.kind.chunk}"),
            (call.softcap is not None and not self.softcap, "logit soft-capping"),
            (call.sinks is not None and not self.sinks, "attention sinks"),
            (call.alibi_slopes is not None and not self.alibi, "ALiBi"),
            (spec.token_terms and not self.token_terms, "per-token sinks or relative bias"),
            (
                head_dim != v_head_dim and not self.unequal_head_dims,
                f"keys of head dim {head_dim} and values of {v_head_dim} (MLA)",
            ),
        )
        return next((f"layer {spec.layer} asks for {what}" for missing, what in asked if missing), None)
