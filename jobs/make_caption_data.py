"""Builds what jobs/caption.yaml runs on, with no download: a small image set (coloured shapes drawn with Pillow),
a Parquet table of caption requests naming them, and a tiny LLaVA model directory (a CLIP vision tower and a
Llama language model with random weights, the embedded model's tokenizer with an `<image>` token, a PIL image
processor and a chat template that places image parts). Its captions are noise: point the job's `model.path`
at a real LLaVA or Idefics3 checkpoint for real ones.

Run: .venv/bin/python jobs/make_caption_data.py [--out jobs/data/caption] [--images 24]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

# a chat template that places an image part's token (the embedded model's template takes strings alone)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def draw(shape: str, colour: str, size: int = 64):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (250, 250, 245))
    pen = ImageDraw.Draw(image)
    box = (size // 6, size // 6, size - size // 6, size - size // 6)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(size // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return image


def make_images(out: Path, count: int) -> list[dict]:
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    rows = []
    for i in range(count):
        shape, colour = SHAPES[i % len(SHAPES)], rng.choice(sorted(COLOURS))
        name = f"images/{i:03d}-{colour}-{shape}.png"
        draw(shape, colour).save(out / name)
        prompt = rng.choice(
            ["Describe this image.", "What shape is this?", "Caption this picture in one line."]
        )
        rows.append({"id": f"img-{i:03d}", "image": name, "prompt": prompt, "shape": shape, "colour": colour})
    return rows


TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16
)
TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8
)


def make_model(
    target: Path, tokenizer_from: Path, text_shape=TINY_TEXT, vision_shape=TINY_VISION, image_size: int = 32
) -> Path:
    """A random-weight LLaVA with its processor, saved in `target` (tiny unless the shapes say otherwise; its
    images are resized and cropped to `image_size`)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = dict(
        text_shape,
        model_type="llama",
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=2048,
        initializer_range=0.3,
    )
    vision = dict(vision_shape, model_type="clip_vision_model", image_size=image_size)
    cfg = AutoConfig.for_model(
        "llava", text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids("<image>")
    )
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(target)
    images = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=vision_shape["patch_size"],
        vision_feature_select_strategy="default",
        chat_template=TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,
    ).save_pretrained(target)
    return target


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun.model_loader import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "caption")
    parser.add_argument("--images", type=int, default=24)
    args = parser.parse_args()
    rows = make_images(args.out, args.images)
    pq.write_table(pa.Table.from_pylist(rows), args.out / "captions.parquet")
    make_model(args.out / "model", resolve_model_dir(None))
    print(f"{len(rows)} images, {args.out / 'captions.parquet'}, and a tiny LLaVA in {args.out / 'model'}")


if __name__ == "__main__":
    main()
