"""SmolVLM's processor reads its video processor's frame-sampling defaults even for images.

Why: batchrun builds a processor without torchvision with a stand-in for its video processor (loading.NoVideo):
batchrun gives no video. SmolVLM's `apply_chat_template` reads the video processor's `num_frames` and `fps`
whatever the conversation holds; the stand-in answers None for them (sample no frames). Anything else asked of
it stays an error, never a silent default.

Checks: configs of `model_type` smolvlm. Provides: `video_stand_in`.
"""

from __future__ import annotations

from batchrun.engine.model.families.adapter import FamilyAdapter


class SmolVLMVideoDefaults(FamilyAdapter):
    name = "SmolVLM's frame-sampling defaults"
    model_types = frozenset({"smolvlm"})

    def video_stand_in(self, config) -> dict:
        return {"num_frames": None, "fps": None}


ADAPTER = SmolVLMVideoDefaults()
