"""Images in prompts: what a sequence carries, and the vision encoder's outputs waiting to enter prefill.

A vision-language model's processor (`AutoProcessor`) expands each image into the model's placeholder tokens in
the prompt text, before tokenizing, and turns the image into pixel values (`ImageInputs`). batchrun computes
each image's features once, with the model's own encoder (`get_image_features`, batched over the images a step
needs, each distinct image once), keeps them while the sequence's prompt is prefilled (`EncoderCache`: one
manager for this resource, its bytes counted), and hands the rows of the image tokens a step computes to the
model's own forward as `mm_encoder_outputs`: the model merges them into its embeddings itself (its placeholder
mask, its scatter), as under `generate`. Nothing of the merge is written here.

The image tokens are computed at 1-D positions or at the model's own 3-D ones (families.qwen_mrope: Qwen-VL,
Qwen 3.5), causally, and may then be split across prefill chunks, or, where one image's tokens see each other
(families.gemma_image_blocks: Gemma 3 and 4), with that mask and each image in one chunk; a family with a rule of
its own that no family adapter writes down is refused images at load (`images_unsupported_reason`). The image tokens' K/V live in the pages like any
other tokens', so they are swapped, shared and counted like them; for prefix sharing, each image token is keyed
by the bytes of the prompt's images (`ImageInputs.key_tokens`), so two different images never share a page.
A sequence's features wait for prefill within a budget the scheduler asks the same manager for."""

from __future__ import annotations

import bisect
import functools
import hashlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from batchrun.engine.model import families
from batchrun.engine.model.structure import text_config


@dataclass
class ImageInputs:
    """A prompt's images, as the processor made them, one entry per image in prompt order: an image (LLaVA),
    all of a prompt's images as one tensor of tiles (Idefics3's processor batches by prompt), or an image's
    patches (Qwen-VL's processor gives every image's patches in one tensor, each image's rows counted by its
    `image_grid_thw`: `packed`)."""

    pixel_values: list[torch.Tensor]  # per image: the processor's pixel values of it (its first axis dropped)
    # per image: the processor's other per-image tensors (image_sizes, image_grid_thw, ...)
    extra: list[dict[str, torch.Tensor]]
    digests: list[bytes]  # per image: SHA-256 of its pixel values (the encoder runs once per distinct one)
    positions: list[int]  # the prompt positions of image tokens, ascending
    # the prompt as the prefix cache keys it: each image token replaced by a negative id drawn from the images'
    # digests (never a token id), so pages of image tokens are shared only between prompts whose images are
    # the same, in the same order
    key_tokens: list[int]
    packed: bool = False  # the images' patches are concatenated for the encoder, not stacked
    # the processor's per-token tensors [1, prompt length] (Qwen-VL's mm_token_type_ids)
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # a model with 3-D rotary positions (families.MRope): the prompt's positions [3, prompt length] and the offset of
    # every later token's position from its index; None: each token's position is its index
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0

    @classmethod
    def from_processor(cls, outputs: dict, image_token_id: int, prompt: list[int]) -> ImageInputs:
        """Split a processor's batch of one prompt's images per image: tensors with one row per image, or
        patches counted per image by `image_grid_thw`."""
        pixel_values = outputs["pixel_values"]
        token_inputs = {
            k: v
            for k, v in outputs.items()
            if k not in ("input_ids", "attention_mask")
            and isinstance(v, torch.Tensor)
            and v.dim() == 2
            and tuple(v.shape) == (1, len(prompt))
        }
        extra = {
            k: v
            for k, v in outputs.items()
            if k not in ("pixel_values", "input_ids", "attention_mask", *token_inputs)
            and isinstance(v, torch.Tensor)
        }
        grid = extra.get("image_grid_thw")
        if grid is not None:
            pixels = list(pixel_values.split(grid.prod(-1).tolist()))
        else:
            pixels = [pixel_values[i] for i in range(pixel_values.shape[0])]
        for k, v in extra.items():
            if v.shape[0] != len(pixels):
                raise ValueError(f"the processor's `{k}` has no row per image; batchrun cannot split it")
        positions = [p for p, t in enumerate(prompt) if t == image_token_id]
        if not positions:
            raise ValueError(
                f"the model's processor placed no image token (id {image_token_id}) for this prompt's images"
            )
        digests = [
            hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).digest() for x in pixels
        ]
        key = -1 - (int.from_bytes(hashlib.sha256(b"".join(digests)).digest()[:8], "big") >> 1)
        key_tokens = list(prompt)
        for p in positions:
            key_tokens[p] = key
        return cls(
            pixel_values=pixels,
            extra=[{k: v[i] for k, v in extra.items()} for i in range(len(pixels))],
            digests=digests,
            positions=positions,
            key_tokens=key_tokens,
            packed=grid is not None,
            token_inputs=token_inputs,
        )

    @property
    def num_images(self) -> int:
        return len(self.pixel_values)

    @functools.cached_property
    def blocks(self) -> list[tuple[int, int]]:
        """The prompt's runs of consecutive image tokens, (start, end) positions: one image's tokens, which
        attend to each other on models with bidirectional image attention (families.ImageBlocks)."""
        runs: list[tuple[int, int]] = []
        for p in self.positions:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return runs

    def keep_whole(self, start: int, n: int, first: bool) -> int:
        """Tokens to compute from `start` when at most `n` are asked, so that no image's tokens are split: a
        chunk that would end inside an image ends before it, or, when it begins with the image, takes all of it
        (past `n`) if it is the step's first (`first`), else none this step."""
        end = start + n
        for b0, b1 in self.blocks:
            if b0 < end < b1:
                if b0 > start:
                    return b0 - start
                return b1 - start if first else 0
        return n

    def rows(self, start: int, end: int) -> range:
        """The rows of the prompt's image features (in token order) that positions start..end-1 take."""
        return range(bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end))


def is_vision_language(config) -> bool:
    """A vision-language model's config: it has a vision encoder's (`vision_config`)."""
    return hasattr(config, "vision_config")


def image_token_id(config) -> int | None:
    """The placeholder token of a vision-language model's images (None: a text model)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def images_unsupported_reason(model) -> str | None:
    """Why batchrun cannot feed this model images exactly, or None. It passes the images' features to the
    model's own forward (`mm_encoder_outputs`) over a packed row of causal attention at 1-D positions, or with
    what a family adapter writes down for the model's family (its 3-D positions, one image's tokens seeing each
    other: families.image_refusal refuses a family with such rules of its own that no adapter covers)."""
    if image_token_id(model.config) is None or not is_vision_language(model.config):
        return "it is a text model"
    if not hasattr(model, "get_image_features"):
        return "it has no image encoder (`get_image_features`)"
    if "mm_encoder_outputs" not in inspect.signature(model.forward).parameters:
        return "its forward takes no precomputed image features (`mm_encoder_outputs`)"
    return families.image_refusal(model)


def _feature_rows(output: Any, hidden: int) -> list[torch.Tensor]:
    """Per image, its features [tokens, hidden x streams], from what `get_image_features` returned: the
    features that replace its placeholder tokens' embeddings, then the further streams a family adapter reads
    (families.feature_streams: Qwen3-VL's deepstack), side by side."""
    pooled = output.pooler_output if hasattr(output, "pooler_output") else output
    if isinstance(pooled, torch.Tensor) and pooled.dim() == 2:
        pooled = [pooled]
    streams = [[p.reshape(-1, hidden) for p in pooled]]
    for layer in families.feature_streams(output):
        streams.append([p.reshape(-1, hidden) for p in layer])
    return [torch.cat(rows, dim=-1) for rows in zip(*streams, strict=True)]


def image_feature_bytes(model) -> int:
    """Bytes of one image token's features while they wait for prefill: the language model's hidden size, once
    and once more per further stream (families.extra_feature_streams: Qwen3-VL's deepstack layers), in the
    model's dtype."""
    streams = 1 + families.extra_feature_streams(model)
    itemsize = next(model.parameters()).dtype.itemsize
    return text_config(model.config).hidden_size * streams * itemsize


class EncoderCache:
    """The vision encoder's outputs of the sequences being prefilled: per sequence, its images' features in
    token order, from when a step first needs them until its prompt's last image token is computed. Images of a
    step are encoded together, each distinct one once; the bytes held are counted (`num_bytes`), and the
    statistics read images encoded, encoder seconds and image tokens.

    It is the scheduler's manager of this resource too, with one record of who holds features (`held`): how
    many image tokens' features may wait for prefill at once, `max_tokens`. A chunk that would make a sequence
    start holding them beside more than `max_tokens` held already ends before its first image token (or waits a
    step), unless none are held, so that a prompt with more image tokens than the budget still runs, alone. The
    engine sizes the budget and takes its bytes out of the KV memory budget."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int):
        self.model = model
        self.device = device
        self.max_tokens = max_tokens
        self.hidden = text_config(model.config).hidden_size
        # seq_id -> [image tokens, hidden x streams] (_feature_rows): a running sequence between the step that
        # computes its first image token and the one that computes its last (a preempted one's are released)
        self.held: dict[int, torch.Tensor] = {}
        self.held_tokens = 0  # image tokens whose features this plan holds (new_step, then take)
        self._taken: set[int] = set()  # sequences this plan starts holding, encoded when its step runs
        self.output_class: type | None = None  # what `get_image_features` returns, to hand the model the same
        self.pooled_per_image = (
            True  # its pooler_output: a tuple per image (LLaVA, Qwen), else one tensor (Gemma)
        )
        self.images_encoded = 0
        self.encoder_seconds = 0.0
        self.image_tokens = 0
        self.peak_bytes = 0  # the most feature bytes held at once

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())

    # ---- the scheduler's side: the budget -------------------------------------------------------------------
    def new_step(self) -> None:
        """A plan begins: the features held are those of `held`."""
        self._taken.clear()
        self.held_tokens = sum(len(rows) for rows in self.held.values())

    def _starts(self, seq, start: int, n: int) -> bool:
        return (
            seq.images is not None
            and seq.seq_id not in self.held
            and seq.seq_id not in self._taken
            and len(seq.images.rows(start, start + n)) > 0
        )

    def fit(self, seq, start: int, n: int) -> int:
        """Tokens of seq to compute from `start`, at most n: up to its first image token in the chunk where its
        features do not fit beside those held."""
        if not self.held_tokens or not self._starts(seq, start, n):
            return n
        if self.held_tokens + len(seq.images.positions) <= self.max_tokens:
            return n
        return seq.images.positions[seq.images.rows(start, start + n).start] - start

    def take(self, seq, start: int, n: int) -> None:
        """seq computes start..start+n this step: its features are held from now if it starts needing them."""
        if self._starts(seq, start, n):
            self._taken.add(seq.seq_id)
            self.held_tokens += len(seq.images.positions)

    # ---- the runner's side: the features --------------------------------------------------------------------

    def encode(self, requests: list[tuple[int, ImageInputs]]) -> None:
        """Features for each (req_id, images) whose images are not held yet: one encoder call per image shape,
        each distinct image (by its pixel values' digest) once."""
        wanted = [(i, images) for i, images in requests if i not in self.held]
        if not wanted:
            return
        t0 = time.perf_counter()
        unique: dict[bytes, tuple[torch.Tensor, dict]] = {}
        per_seq: list[list[bytes]] = []
        for _, images in wanted:
            keys = []
            for key, pixels, extra in zip(images.digests, images.pixel_values, images.extra):
                unique.setdefault(key, (pixels, extra))
                keys.append(key)
            per_seq.append(keys)
        features: dict[bytes, torch.Tensor] = {}
        packed = wanted[0][1].packed  # one processor, one form
        by_shape: dict[tuple, list[bytes]] = {}  # packed patches go in one call whatever the images' sizes
        for key, (pixels, _) in unique.items():
            by_shape.setdefault(() if packed else tuple(pixels.shape), []).append(key)
        dtype = next(self.model.parameters()).dtype
        join = torch.cat if packed else torch.stack
        for keys in by_shape.values():
            pixels = join([unique[k][0] for k in keys]).to(self.device, dtype)
            extra = {
                name: torch.stack([unique[k][1][name] for k in keys]).to(self.device)
                for name in unique[keys[0]][1]
            }
            with torch.inference_mode():
                out = self.model.get_image_features(pixel_values=pixels, **extra, return_dict=True)
            self.output_class = type(out)
            self.pooled_per_image = isinstance(getattr(out, "pooler_output", None), tuple | list)
            for key, rows in zip(keys, _feature_rows(out, self.hidden), strict=True):
                features[key] = rows
        for (req_id, images), keys in zip(wanted, per_seq):
            rows = torch.cat([features[k] for k in keys])
            if rows.shape[0] != len(images.positions):
                raise ValueError(
                    f"the processor placed {len(images.positions)} image tokens but the encoder gave "
                    f"{rows.shape[0]} feature rows"
                )
            self.held[req_id] = rows
        self.peak_bytes = max(self.peak_bytes, self.num_bytes)
        self.images_encoded += len(unique)
        self.image_tokens += sum(len(images.positions) for _, images in wanted)
        self.encoder_seconds += time.perf_counter() - t0

    def step_inputs(self, chunks: list[tuple[int, ImageInputs | None, int, int]]) -> dict:
        """The model's `mm_encoder_outputs` keyword for a step: the feature rows of the image tokens each
        (req_id, images, start, end) computes, in packed order (the runner's batch holds the images); {} when
        the step computes no image token."""
        needs = [(i, images, images.rows(a, b)) for i, images, a, b in chunks if images is not None]
        needs = [n for n in needs if len(n[2])]
        if not needs:
            return {}
        self.encode([(i, images) for i, images, _ in needs])
        rows = [self.held[i][r.start : r.stop] for i, _, r in needs]
        for i, images, _, b in chunks:  # a prompt past its last image token needs its features no more
            if images is not None and i in self.held and b > images.positions[-1]:
                del self.held[i]
        streams = torch.cat(rows).split(self.hidden, dim=-1)
        output = self.output_class(pooler_output=(streams[0],) if self.pooled_per_image else streams[0])
        families.with_feature_streams(self.model, output, list(streams[1:]))  # Qwen3-VL's deepstack
        return {"mm_encoder_outputs": {"image": output}}

    def release(self, sequences: list) -> None:
        """Drop the features of these sequences (preempted: the scheduler's budget counts running ones only)."""
        for s in sequences:
            self.held.pop(s.seq_id, None)

    def clear(self) -> None:
        """Drop every held output (the engine's requests were aborted)."""
        self.held.clear()
