"""Which keys a query sees: the mask rules every backend, the reference and the packed (pooling) attention
share."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskKind:
    """Which keys a query at position p sees: all earlier ones (full causal), the last `window` (sliding window:
    p - window < k <= p, as transformers' masks have it) or those of its own chunk (k // chunk == p // chunk).
    `causal` False: an encoder's layer (vLLM's ENCODER_ONLY attention: BERT, ModernBERT), later keys seen too,
    a window on both sides (|p - k| < window); it keeps no K/V, so only the packed attention of a pooling job
    runs it (packed.py), and the generation engine refuses it at load (model_plan.py)."""

    window: int | None = None
    chunk: int | None = None
    causal: bool = True

    @property
    def is_full(self) -> bool:
        return self.window is None and self.chunk is None

    def first_key(self, pos: int) -> int:
        """The first key position a query at `pos` sees."""
        if self.window is not None:
            return max(0, pos - self.window + 1)
        if self.chunk is not None:
            return pos - pos % self.chunk
        return 0

    def first_keys(self, pos: torch.Tensor) -> torch.Tensor:
        """`first_key` of each position of a tensor."""
        if self.window is not None:
            return (pos - self.window + 1).clamp_(min=0)
        if self.chunk is not None:
            return pos - pos % self.chunk
        return torch.zeros_like(pos)

    def visible(
        self,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        images: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """[n, m] bool: query_pos [n] sees key_pos [m]. `images`: (start, end) positions of images whose tokens
        see each other (families.ImageBlocks), later ones included, within the window or chunk."""
        q, k = query_pos[:, None], key_pos[None, :]
        causal = self.causal
        seen = (
            k <= q if causal else torch.ones(len(query_pos), len(key_pos), dtype=torch.bool, device=q.device)
        )
        if images:
            qi, ki = image_of(query_pos, images)[:, None], image_of(key_pos, images)[None, :]
            seen |= (qi == ki) & (qi >= 0)
        if self.window is not None:
            seen &= k > q - self.window
            if not causal:
                seen &= k < q + self.window
        if self.chunk is not None:
            seen &= k // self.chunk == q // self.chunk
        return seen


FULL = MaskKind()


def image_of(pos: torch.Tensor, images: list[tuple[int, int]]) -> torch.Tensor:
    """[n] the index of the image each position is a token of, -1 for none."""
    which = torch.full_like(pos, -1)
    for j, (start, end) in enumerate(images):
        which[(pos >= start) & (pos < end)] = j
    return which
