"""What a backend declares it computes: the engine asks these, never a backend's name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a backend computes beyond paged causal attention. Every backend computes sliding windows, chunks,
    soft-capping, per-head and per-token sinks and the relative bias (the family matrix runs each); they differ
    in `image_blocks`: one image's tokens seeing each other during prefill (families.ImageBlocks)."""

    image_blocks: bool
