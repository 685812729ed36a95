"""Qwen-VL's and Qwen 3.5's 3-D rotary positions (mrope) for image tokens.

Why: an image token's position is its (time, row, column) in the image's grid of merged patches, offset by where
the image starts; the text after an image goes on from the image's start plus its larger side, so a prompt with
images ends `rope_delta` positions below its length (a negative delta), and every token after the prompt is at
its index plus that delta. 1-D positions would be a silent difference.

Checks at load: the families below (each tested against HF `generate` in tests/test_image_families.py), with a
`get_rope_index`; another family with a `get_rope_index` of its own is refused images (families.image_refusal),
never computed by this rule. Provides: `image_positions` (an `MRope`, which the engine asks for each prompt's
positions when it is queued and the model runner for each step's).
"""

from __future__ import annotations

from typing import Any

import torch

from batchrun.engine.model.families.adapter import IMAGE_POSITIONS, FamilyAdapter


class QwenMRope(FamilyAdapter):
    name = "Qwen-VL's 3-D rotary positions"
    model_types = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
    image_rule = IMAGE_POSITIONS

    def image_positions(self, model) -> MRope | None:
        owner = MRope.find_owner(model)
        return MRope(owner) if owner is not None else None


class MRope:
    """A model's 3-D positions. A prompt's come from the model's own `get_rope_index`, once per prompt
    (`prompt_positions`); a step's are its tokens' indices plus their sequence's delta, with each prompt chunk's
    taken from its prompt's positions (`step_positions`), and reach the model's forward as `position_ids`
    [3, 1, T], as `generate` gives them. A prompt without images has the 1-D positions in all three rows, as
    under `generate`."""

    def __init__(self, owner: torch.nn.Module):
        self.owner = owner  # the module with the model's `get_rope_index`

    @staticmethod
    def find_owner(model: torch.nn.Module) -> torch.nn.Module | None:
        """The module with the model's `get_rope_index`, if it has one."""
        return next((m for m in (model, getattr(model, "model", None)) if hasattr(m, "get_rope_index")), None)

    def prompt_positions(self, prompt: list[int], images) -> tuple[torch.Tensor, int]:
        """The prompt's positions [3, prompt length] and the delta of the tokens after it (`images`: the
        prompt's multimodal.ImageInputs)."""
        grids = torch.stack([e["image_grid_thw"] for e in images.extra])
        with torch.inference_mode():
            positions, delta = self.owner.get_rope_index(
                torch.tensor([prompt]), image_grid_thw=grids, **images.token_inputs
            )
        return positions[:, 0], int(delta.reshape(-1)[0])

    @staticmethod
    def step_positions(positions: torch.Tensor, chunks: list[tuple[int, Any, int, int]]) -> torch.Tensor:
        """A step's position_ids [3, 1, T] from its 1-D positions [T] and its (req_id, images, start, end)
        chunks in packed order (model_runner.ModelRunner.prepare)."""
        deltas = [images.rope_delta if images is not None else 0 for _, images, _, _ in chunks]
        rows = positions
        if any(deltas):
            lengths = torch.tensor([b - a for _, _, a, b in chunks])
            rows = positions + torch.repeat_interleave(torch.tensor(deltas), lengths).to(positions)
        rows = rows.expand(3, -1).clone()
        offset = 0
        for _, images, a, b in chunks:
            rope = images.rope_positions if images is not None else None
            if rope is not None and a < rope.shape[1]:
                end = min(b, rope.shape[1])
                rows[:, offset : offset + end - a] = rope[:, a:end]
            offset += b - a
        return rows[:, None]


ADAPTER = QwenMRope()
