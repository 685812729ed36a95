"""Gemma 3's and Gemma 4's image tokens see each other during prefill (bidirectional image attention).

Why: transformers builds these models' masks from the processor's token types so that one image's tokens see
each other, the later ones included, on top of what the layer's mask shows (for a sliding layer, within its
window: AND(window, OR(causal, same image))). Gemma 3 opens every layer, unless its config's
`use_bidirectional_attention` is set (then every token sees every other: an encoder, refused images); Gemma 4
opens its sliding layers only, with `use_bidirectional_attention: "vision"`, and is causal without it. A
prefill chunk then never splits an image's tokens (multimodal.ImageInputs.keep_whole); a decoding token, never
an image token, is causal as ever.

Checks at load: the two families; another family whose token types steer its image attention is refused images
(families.image_refusal). Provides: `image_blocks` (an `ImageBlocks`; the backend must have the capability,
else the engine refuses images).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.model.families.adapter import IMAGE_ATTENTION, FamilyAdapter


@dataclass(frozen=True)
class ImageBlocks:
    """One image's tokens see each other during prefill, on every layer or on the sliding ones alone."""

    sliding_only: bool

    def applies(self, kind) -> bool:
        """Whether layers of this mask kind (attention.MaskKind) open an image's tokens to each other."""
        return not self.sliding_only or kind.window is not None


class GemmaImageBlocks(FamilyAdapter):
    name = "Gemma's bidirectional image attention"
    model_types = frozenset({"gemma3", "gemma4"})
    image_rule = IMAGE_ATTENTION

    def image_blocks(self, model) -> ImageBlocks | None:
        family, bidirectional = model.config.model_type, bidirectional_attention(model.config)
        if family == "gemma3" and not bidirectional:
            return ImageBlocks(sliding_only=False)
        if family == "gemma4" and bidirectional == "vision":
            return ImageBlocks(sliding_only=True)
        return None


def bidirectional_attention(config):
    """The language model's `use_bidirectional_attention` (None where it has none)."""
    return getattr(config.get_text_config(), "use_bidirectional_attention", None)


ADAPTER = GemmaImageBlocks()
