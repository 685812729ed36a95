"""Images on families whose image tokens are more than causal tokens at 1-D positions, against HF `generate`
(processor + model, one conversation at a time, greedy fp32), on tiny random-weight models:

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen 3.5 (and the MoE ones of the last two): 3-D rotary positions
  (families.qwen_mrope); Qwen3-VL's deepstack features added after its first decoder layers; Qwen 3.5 a hybrid
  (Gated DeltaNet layers with a state slot per sequence beside gated attention).
- Gemma 3 and 4: one image's tokens attend to each other, later ones included (families.gemma_image_blocks), on every
  layer (Gemma 3) or on the sliding layers (Gemma 4), so a prefill chunk never splits an image.
- Mistral 3: causal, at 1-D positions, but its processor (Pixtral's) imports torchvision: skipped where torchvision
  does not import (beside the CPU torch wheel `make install` uses); run with torch 2.14.1 and torchvision 0.29.1.
- SmolVLM: Idefics3's tiles and global view, causal; its own processor (which needs `num2words`, and reads its
  video processor's frame defaults even for images), built as batchrun builds it.
- Inkling 2: causal image tokens beside its hybrid text model (short convolutions, a relative position bias,
  per-token sinks); its image processor needs torchvision, so skipped where torchvision does not import, as
  Mistral 3 is. Without torchvision both still run text (test_a_processor_that_needs_torchvision_...).

The Qwen processors are the models' own classes; their video processors need torchvision, which does not
install beside the CPU torch wheel, so both sides load them as batchrun does (`loading.load_processor`: the image
processor's PIL path, no video processor, where `AutoProcessor` fails for want of torchvision)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_vlm
from test_images import picture

from batchrun import LLM, SamplingParams

NEW_TOKENS = 32
sys.path.insert(0, str(Path(__file__).parent))

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "gemma4",
    "mistral3",
    "smolvlm",
    "inkling2",
]
# Gemma's image markers, which its processor reads off the tokenizer
GEMMA_IMAGE_MARKS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
CHAT = (  # a chat template that places an image part as `image` (each family's marker)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}IMAGE"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_parts(target: Path, tok, image_marker: str, processor_options: dict | None = None) -> None:
    """A processor saved as its parts, for `AutoProcessor` or batchrun's loader to build: the tokenizer with CHAT
    placing an image part as `image_marker`, and the processor's own options (the image processor is saved by
    the caller)."""
    tok.chat_template = CHAT.replace("IMAGE", image_marker)
    tok.save_pretrained(target)
    if processor_options is not None:
        (target / "processor_config.json").write_text(json.dumps(processor_options))


def make_qwen_vl(family: str, target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight model of `family` with the embedded model's tokenizer (plus Qwen's vision tokens)
    and a PIL image processor that makes images of 4 to 16 tokens."""
    from model_families import LINEAR, THREE_LINEAR_ONE_FULL, tiny_text
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    names = ["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"]
    ids = dict(zip(names, tok.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    text = tiny_text(len(tok))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        depth=2,
        num_heads=2,
        out_hidden_size=64,
        spatial_merge_size=2,
        initializer_range=0.3,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen2_vl":  # its vision tower: embed_dim wide, hidden_size its merger's output
        vision = dict(embed_dim=32, hidden_size=64, depth=2, num_heads=2, mlp_ratio=2, patch_size=14)
        vision.update(spatial_merge_size=2, initializer_range=0.3)
    elif family == "qwen2_5_vl":
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
    else:
        rope["mrope_interleaved"] = True
        vision.update(patch_size=16, num_position_embeddings=64)
    if family.startswith("qwen3_vl"):
        vision["deepstack_visual_indexes"] = [0, 1]
    if family.startswith("qwen3_5"):
        text.update(LINEAR, num_hidden_layers=4, layer_types=THREE_LINEAR_ONE_FULL)
        rope["partial_rotary_factor"] = 1.0
    if family == "qwen3_5_moe":
        text.update(moe, shared_expert_intermediate_size=32)
    if family == "qwen3_vl_moe":
        text.update(moe, decoder_sparse_step=1)
    text["rope_parameters"] = rope
    cfg = AutoConfig.for_model(family, text_config=text, vision_config=vision, **ids)
    save_vlm(cfg, target)
    side = vision["patch_size"] * 2  # a merged patch
    Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], min_pixels=side * side * 4, max_pixels=side * side * 16
    ).save_pretrained(target)
    save_parts(target, tok, "<|vision_start|><|image_pad|><|vision_end|>")


def make_gemma3(target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight Gemma 3: images of 16 tokens (a 64-pixel image in 8-pixel patches, pooled 2 x 2),
    sliding layers of an 8-token window (narrower than an image) beside full ones, Gemma's embedding scale;
    untied output embeddings and perturbed norms, or it repeats its last token whatever it is shown."""
    from model_families import TINY_VISION, tiny_text
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = AutoTokenizer.from_pretrained(tokenizer_from, extra_special_tokens=GEMMA_IMAGE_MARKS)
    text = tiny_text(
        len(tok),
        sliding_window=8,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
    )
    vision = dict(TINY_VISION, image_size=64, patch_size=8)
    cfg = AutoConfig.for_model(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        tie_word_embeddings=False,
    )
    save_vlm(cfg, target, perturbed=True)
    Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 64, "width": 64}),
        tokenizer=tok,
        chat_template=CHAT.replace("IMAGE", "<start_of_image>"),
        image_seq_length=16,
    ).save_pretrained(target)


def make_gemma4(target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight Gemma 4 with images: the text model of tests/model_families.py's `gemma4_text`
    (full layers of other head sizes, KV-shared layers, per-layer inputs) with use_bidirectional_attention
    "vision" (one image's tokens see each other on the sliding layers only) and a sliding window of 8 tokens; a
    vision tower of 8-pixel patches pooled 2 x 2 (images of about 60 tokens). Its processor is built without its
    video processor and audio feature extractor (loading.load_processor), as batchrun builds it; the tokenizer
    carries Gemma 4's image and audio markers, which the processor reads."""
    from model_families import SUPPORTED, TINY_VISION, tiny_text
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    audio = {
        "audio_token": "<audio_soft_token>",
        "boa_token": "<start_of_audio>",
        "eoa_token": "<end_of_audio>",
    }
    tok = AutoTokenizer.from_pretrained(tokenizer_from, extra_special_tokens={**GEMMA_IMAGE_MARKS, **audio})
    tok.add_special_tokens({"additional_special_tokens": ["<|video|>"]})
    mine = dict(vocab_size_per_layer_input=len(tok), use_bidirectional_attention="vision", sliding_window=8)
    text = tiny_text(len(tok), **{**SUPPORTED["gemma4_text"][1], **mine})
    vision = dict(
        TINY_VISION,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=8,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    cfg = AutoConfig.for_model(
        "gemma4",
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        tie_word_embeddings=False,
    )
    save_vlm(cfg, target, perturbed=True)
    Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(target)
    save_parts(target, tok, "<image_soft_token>")


def make_mistral3(target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight Mistral 3 (a Pixtral vision tower, images of any size in rows of patches ended by
    [IMG_BREAK], a 2 x 2 patch merger). Its processor imports torchvision, so it is saved as its parts (the PIL
    image processor, the tokenizer with the chat template, the processor's options), which `AutoProcessor`
    puts together where torchvision imports."""

    from model_families import TINY_VISION, tiny_text
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    text = tiny_text(len(tok), model_type="mistral")
    vision = dict(TINY_VISION, model_type="pixtral", head_dim=16, patch_size=8, image_size=64)
    cfg = AutoConfig.for_model(
        "mistral3",
        text_config=text,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    save_vlm(cfg, target)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8).save_pretrained(target)
    options = {"patch_size": 8, "spatial_merge_size": 2, "processor_class": "PixtralProcessor"}
    save_parts(target, tok, "[IMG]", options)


def make_inkling2(target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight Inkling 2 (the vision-language model its checkpoints are): the text model of
    tests/model_families.py's `inkling2_text` (a hybrid of short convolutions, relative position bias, per-token
    sinks) beside a tiny vision tower. Its image processor has torchvision as its only backend."""
    from model_families import SUPPORTED, tiny_text
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    mine = {k: v for k, v in SUPPORTED["inkling2_text"][1].items() if k != "_drop"}
    text = tiny_text(len(tok), **{**mine, "unpadded_vocab_size": len(tok), "eos_token_id": tok.eos_token_id})
    del text["intermediate_size"]
    vision = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=8,
        posemb_grid_size=4,
        text_hidden_size=text["hidden_size"],
        projection_hidden_dim=64,
    )
    image_token_id = tok.convert_tokens_to_ids("<|image|>")
    cfg = AutoConfig.for_model(
        "inkling2", text_config=text, vision_config=vision, image_token_id=image_token_id
    )
    save_vlm(cfg, target)
    save_parts(target, tok, "<|image|>", {"processor_class": "Inkling2Processor", "image_token": "<|image|>"})
    image_processor = {
        "image_processor_type": "Inkling2ImageProcessor",
        "processor_class": "Inkling2Processor",
        "size": {"height": 16, "width": 16},  # a token's patch: 2 x 2 of the tower's 8-pixel patches
    }
    (target / "preprocessor_config.json").write_text(json.dumps(image_processor))


@pytest.mark.parametrize("family", ["mistral3", "inkling2"])
def test_a_processor_that_needs_torchvision_leaves_text_rows_running(family, tmp_path, model_dir):
    """Mistral 3 and Inkling 2 where torchvision does not import (the default install; Pixtral's processor and
    Inkling 2's image processor need it): text conversations run on the tokenizer, equal to HF `generate` on
    the same ids; in a job, a conversation with an image is that row's error naming torchvision, and its
    batch-mates run (from Python, ValueError)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_images import NEW_TOKENS as JOB_TOKENS
    from test_images import data_url, read_outputs, submit

    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip(
            "torchvision imports here: the processor is built, and test_images_equal_hf_generate runs"
        )
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    target = tmp_path / family
    {"mistral3": make_mistral3, "inkling2": make_inkling2}[family](target, model_dir)
    text = [{"role": "user", "content": "No image here, just text."}]
    image_url = {"type": "image_url", "text": None, "image_url": {"url": data_url(picture(0))}}
    with_image = [
        {"role": "user", "content": [image_url, {"type": "text", "text": "Describe.", "image_url": None}]}
    ]
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok(
        tok.apply_chat_template(text, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    model = AutoModelForImageTextToText.from_pretrained(target, attn_implementation="eager").eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids["input_ids"]]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = ref[0, len(ids["input_ids"]) :].tolist()

    text[0]["content"] = [{"type": "text", "text": text[0]["content"], "image_url": None}]  # Parquet's struct
    pq.write_table(pa.table({"id": ["t", "i"], "prompt": [text, with_image]}), tmp_path / "in.parquet")
    submit(
        tmp_path,
        target,
        "text-only",
        f"parquet: {tmp_path / 'in.parquet'}, id_column: id",
        ", token_ids: true",
    )
    got = read_outputs(tmp_path / "out")
    assert got[("t", 0)]["error"] is None and got[("t", 0)]["completion_token_ids"] == expected[:JOB_TOKENS]
    assert got[("i", 0)]["finish_reason"] == "error" and "torchvision" in got[("i", 0)]["error"]

    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64)
    assert llm.processor is None and "torchvision" in llm.images_unavailable
    with pytest.raises(ValueError, match="torchvision"):
        llm.chat(with_image, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)


def make_smolvlm(target: Path, tokenizer_from: Path) -> None:
    """A tiny random-weight SmolVLM (Idefics3's architecture: each image in 16-pixel tiles, 2 x 2 of them, plus a
    global view, 1 token a tile after its pixel shuffle). Its processor is saved as its parts (the PIL image
    processor, the tokenizer with the chat template, the processor's options): its video processor needs
    torchvision, so `AutoProcessor` cannot build it here, and batchrun builds it without one
    (loading.load_processor)."""

    from model_families import TINY_VISION, tiny_text
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"]}
    )
    vision = dict(TINY_VISION, model_type="smolvlm_vision", image_size=16, patch_size=8)
    cfg = AutoConfig.for_model(
        "smolvlm",
        text_config=tiny_text(len(tok), model_type="llama"),
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    save_vlm(cfg, target)
    SmolVLMImageProcessorPil(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 16}, do_image_splitting=True
    ).save_pretrained(target)
    save_parts(target, tok, "<image>", {"image_seq_len": 1, "processor_class": "SmolVLMProcessor"})


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory, model_dir):
    """(family, model directory, HF processor and model)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from batchrun.engine.model.loading import load_processor

    target = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        make_gemma3(target, model_dir)
    elif request.param == "gemma4":
        make_gemma4(target, model_dir)
    elif request.param == "mistral3":
        pytest.importorskip("torchvision", reason="Pixtral's processor imports torchvision (docs/images.md)")
        make_mistral3(target, model_dir)
    elif request.param == "smolvlm":
        make_smolvlm(target, model_dir)
    elif request.param == "inkling2":
        pytest.importorskip(
            "torchvision", reason="Inkling 2's image processor needs torchvision (docs/images.md)"
        )
        make_inkling2(target, model_dir)
    else:
        make_qwen_vl(request.param, target, model_dir)
        try:  # without torchvision (the CPU wheel's install), the stock loader cannot build the processor
            AutoProcessor.from_pretrained(target)
        except ImportError as e:
            assert "torchvision" in str(e).lower(), e
    processor = load_processor(target, AutoConfig.from_pretrained(target))
    model = AutoModelForImageTextToText.from_pretrained(target, attn_implementation="eager").eval()
    return request.param, target, (processor, model)


def cases():
    """Text alone, one image, two images of other sizes, and the first image again (HF's content, images)."""
    a, b, c = picture(0, 100, 110), picture(1, 80, 130), picture(2, 120, 50)
    return [
        ([{"type": "text", "text": "No image here, just text."}], []),
        ([{"type": "image"}, {"type": "text", "text": "Describe."}], [a]),
        (
            [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ],
            [b, c],
        ),
        ([{"type": "image"}, {"type": "text", "text": "Describe it at length, please."}], [a]),
    ]


def expected_of(reference, cases) -> list[list[int]]:
    processor, model = reference
    out = []
    for content, images in cases:
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        enc = processor(text=text, images=images or None, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ids[0, enc["input_ids"].shape[1] :].tolist())
    return out


def conversations(cases) -> list:
    convs = []
    for content, images in cases:
        pictures = iter(images)
        parts = [{"type": "image", "image": next(pictures)} if p["type"] == "image" else p for p in content]
        convs.append([{"role": "user", "content": parts}])
    return convs


def check_equal_hf(family: str, target: Path, reference, engine: dict) -> None:
    rows = cases()
    # Gemma's sliding and full layers take a page each, SmolVLM's tiled images several; Gemma 4's images of 60
    # tokens, kept whole, take most of its pages alone, so no row of it is preempted here (its chunks are still
    # checked)
    pages = {"gemma3": 10, "gemma4": 30, "smolvlm": 8, "inkling2": 12}.get(family, 5)
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=pages if engine else 256, **engine)
    assert (llm.engine.runner.mrope is not None) == family.startswith("qwen")
    outs = llm.chat(conversations(rows), SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected_of(reference, rows)
    if "preemption" in engine and family != "gemma4":  # an image row was preempted after its prompt
        assert any(o.outputs[0].num_preemptions for o, (_, images) in zip(outs, rows) if images)


@pytest.mark.parametrize(
    "engine",
    [
        dict(),  # prompts whole
        # chunks of 8 tokens (cutting through Qwen's images, each of Gemma's taken whole), few pages
        dict(max_num_batched_tokens=8, preemption="recompute"),
    ],
    ids=["whole", "chunked-recompute"],
)
def test_images_equal_hf_generate(vlm, engine):
    check_equal_hf(*vlm, engine)


# swap moves pages and slots as they are (recompute above rebuilds the positions on every family)
@pytest.mark.parametrize("vlm", ["qwen2_5_vl", "qwen3_5", "gemma3"], indirect=True)
def test_images_equal_hf_generate_under_swap(vlm):
    check_equal_hf(*vlm, dict(max_num_batched_tokens=8, preemption="swap"))


def lapses(family: str, multimodal) -> list[tuple[str, dict, object, object]]:
    """What the model needs, each taken away in turn: (what, engine options, target, replacement)."""
    from batchrun.engine.model import families

    if family.startswith("gemma"):
        return [
            ("causal images", {}, families.ImageBlocks, ("applies", lambda self, kind: False)),
            (
                "images split across chunks of 8 tokens",
                {"max_num_batched_tokens": 8},
                multimodal.ImageInputs,
                ("keep_whole", lambda self, start, n, first: n),
            ),
        ]
    if family == "qwen3_vl":
        real = multimodal._feature_rows

        def no_deepstack(out, hidden):
            return [
                torch.cat([r[:, :hidden], torch.zeros_like(r[:, hidden:])], -1) for r in real(out, hidden)
            ]

        return [("no deepstack", {}, multimodal, ("_feature_rows", no_deepstack))]
    if family in ("mistral3", "smolvlm", "inkling2"):  # causal families: what they need is their features
        real = multimodal._feature_rows

        def zeroed(out, hidden):
            return [torch.zeros_like(r) for r in real(out, hidden)]

        return [("no image features", {}, multimodal, ("_feature_rows", zeroed))]
    return [
        ("1-D positions", {}, families.MRope, ("prompt_positions", lambda self, prompt, images: (None, 0)))
    ]


def test_the_comparison_sees_what_the_model_needs(vlm):
    """The test can fail: with image prompts at 1-D positions (Qwen2.5-VL, Qwen 3.5), Qwen3-VL's deepstack
    features zeroed, Gemma 3's image tokens causal, or Gemma 3's images split across chunks, the image rows
    differ from HF while the text row does not."""
    from batchrun.engine.model import multimodal

    family, target, reference = vlm
    rows = [cases()[0], cases()[2]]  # text alone; two images (the largest offset of positions)
    expected = expected_of(reference, rows)
    for what, engine, owner, (name, replacement) in lapses(family, multimodal):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(owner, name, replacement)
            llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64, **engine)
            outs = llm.chat(conversations(rows), SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == expected[0], what
        assert outs[1].outputs[0].token_ids != expected[1], what


def rows_behind_a_system_prompt(reference, rows, system: str, ask: str) -> tuple[list, list[list[int]]]:
    """Conversations of a system prompt and a user turn of (image, `ask` + question) per row, and each one's
    HF `generate` tokens."""
    processor, model = reference
    convs, expected = [], []
    for image, question in rows:
        content = [{"type": "image"}, {"type": "text", "text": ask + question}]
        convs.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image", "image": image}, content[1]]},
            ]
        )
        text = processor.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=False,
        )
        enc = processor(text=text, images=[image], return_tensors="pt")
        with torch.inference_mode():
            ref = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(ref[0, enc["input_ids"].shape[1] :].tolist())
    return convs, expected


SYSTEM = "You describe pictures for a catalogue. " * 3
ASK = "Answer in one short sentence, naming what you see. " * 2  # a page of text shared after the image


# Qwen2.5-VL's positions, Qwen 3.5's state, Gemma's image attention (Qwen3-VL's and Mistral 3's add nothing here)
@pytest.mark.parametrize("vlm", ["qwen2_5_vl", "qwen3_5", "gemma3"], indirect=True)
def test_prefix_sharing_of_an_image(vlm):
    """Rows with one system prompt and the same image share the image's pages (their 3-D positions, and on Qwen
    3.5 the state snapshot at a page boundary past the image, kept because the next waiting row shares it); a
    row with another image (the same placeholder tokens) must not take them. Each equals HF."""
    family, target, reference = vlm
    a, b = picture(5, 60, 60), picture(6, 60, 60)
    rows = [(a, "Colours?"), (a, "Shapes?"), (b, "Colours?")]
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=128, max_num_seqs=1)
    convs, expected = rows_behind_a_system_prompt(reference, rows, SYSTEM, ASK)
    outs = llm.chat(convs, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    ids = llm.encode_chat(convs[-1]).token_ids
    last_image = len(ids) - 1 - ids[::-1].index(llm.engine.plan.image_token_id)
    assert llm.engine.block_manager.prefix_cache.hit_tokens > last_image  # the second row's image was shared


@pytest.mark.parametrize("vlm", ["qwen3_5"], indirect=True)
def test_a_hybrid_row_admitted_at_a_shared_prefix_keeps_the_encoder_budget(vlm):
    """Qwen 3.5 rows sharing a system prompt and an image, two running at a time in chunks of 16 tokens: a row
    admitted with a state snapshot planned at the prefix it shares with the next waiting row has its first chunk
    cut by the same rules as every other chunk (one chunk policy), the encoder's budget included, so the image
    features waiting for prefill stay within it (or one prompt's own, when larger); every row equals HF."""
    _, target, reference = vlm
    a, b = picture(5, 60, 60), picture(6, 60, 60)
    rows = [(a, "Colours?"), (a, "Shapes?"), (b, "Colours?"), (b, "Shapes?"), (a, "Size?")]
    convs, expected = rows_behind_a_system_prompt(reference, rows, SYSTEM, ASK)
    llm = LLM(
        model=str(target),
        dtype="float32",
        device="cpu",
        num_pages=128,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    outs = llm.chat(convs, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.kv.managers[0].snapshots_taken > 0, "no row was admitted with a snapshot planned"
    counts = llm.engine.image_counts()
    per_token = counts["encoder_budget_bytes"] // 16
    largest = max(len(llm.encode_chat(c).images.positions) for c in convs)
    assert 0 < counts["encoder_peak_bytes"] <= max(16, largest) * per_token


@pytest.mark.parametrize("vlm", ["gemma3"], indirect=True)
def test_a_shared_prefix_that_ends_inside_a_gemma_image(vlm):
    """Two rows with the same image and different questions right after it, the shared pages ending inside the
    image: the second row computes the rest of the image over the first's pages (computed with the whole image)
    and still equals HF."""
    _, target, reference = vlm
    processor, model = reference
    image = picture(7, 60, 60)
    for repeat in range(1, 17):  # a system prompt whose length puts a page boundary inside the image
        system = "Pictures. " * repeat
        turns = [
            [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            ]
            for question in ("Colours?", "Shapes?")
        ]
        encs = [
            processor(
                text=processor.apply_chat_template(t, add_generation_prompt=True, tokenize=False),
                images=[image],
                return_tensors="pt",
            )
            for t in turns
        ]
        a, b = (e["input_ids"][0].tolist() for e in encs)
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        image_tokens = [i for i, t in enumerate(a) if t == model.config.image_token_id]
        shared = common // 16 * 16
        if image_tokens[0] < shared <= image_tokens[-1]:
            break
    else:
        pytest.fail("no system prompt put a page boundary inside the image")
    expected = []
    for enc in encs:
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, enc["input_ids"].shape[1] :].tolist())
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=128, max_num_seqs=1)
    convs = [
        [t[0], {"role": "user", "content": [{"type": "image", "image": image}, t[1]["content"][1]]}]
        for t in turns
    ]
    outs = [llm.chat(c, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)[0] for c in convs]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.block_manager.prefix_cache.hit_tokens == shared


@pytest.mark.parametrize("vlm", ["qwen3_5", "gemma3"], indirect=True)
def test_parallel_samples_of_an_image_prompt(vlm):
    """n = 2 greedy samples of image prompts: the second forks after the prompt (Qwen 3.5 copies its state,
    pages are shared on write) and keeps the prompt's 3-D positions; both equal HF `generate`."""
    _, target, reference = vlm
    rows = cases()[1:3]
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=256)
    outs = llm.chat(conversations(rows), SamplingParams(max_new_tokens=NEW_TOKENS, n=2), use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[e, e] for e in expected_of(reference, rows)]
