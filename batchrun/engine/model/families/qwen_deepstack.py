"""Qwen3-VL's deepstack features: vision features it adds to the image tokens' hidden states after each of its
first decoder layers, beside the features that replace their embeddings.

Why: `get_image_features` returns them (`deepstack_features`: per layer, per image) and the model's forward takes
them back with the main features; a step that hands over only the main ones computes another model. batchrun
keeps them with the main features, side by side in each image token's row (multimodal.EncoderCache), counts them
in the encoder's budget, and hands a step the rows of the image tokens it computes, as one image per layer.

Checks: vision configs with `deepstack_visual_indexes`, outputs with `deepstack_features`.
Provides: `extra_feature_streams`, `feature_streams`, `with_feature_streams`.
"""

from __future__ import annotations

from batchrun.engine.model.families.adapter import FamilyAdapter


class QwenDeepstack(FamilyAdapter):
    name = "Qwen3-VL's deepstack features"

    def extra_feature_streams(self, model) -> int:
        vision = getattr(model.config, "vision_config", None)
        return len(getattr(vision, "deepstack_visual_indexes", None) or [])

    def feature_streams(self, output) -> list[list]:
        return [list(layer) for layer in getattr(output, "deepstack_features", None) or []]

    def with_feature_streams(self, output, streams: list) -> None:
        if streams:
            output.deepstack_features = [(rows,) for rows in streams]


ADAPTER = QwenDeepstack()
