"""Image prompts: 200 rows, each a distinct picture (a coloured shape at its own place) and a short question, on a
small random-weight LLaVA shape (a CLIP vision tower, a Llama language model), fp32, greedy, side by side in
one run:

1. batchrun (a job with `input.image_column`) vs HF `generate` (processor + model, left-padded batches of 16) on
   the same rows: generated tokens/s and images/s of the whole process (timed from outside: Python's start, the
   imports, the model's load and the rows) and of the generation alone;
2. the image encoder's share of batchrun's step time (`time_encode_s` over the steps' phases);
3. a bound on any engine's gain: HF's forward over the same batches' prompts alone (vision encoder and language
   model over every prompt token, the last token's logits: the prefill arithmetic every engine must do, which
   paging does not shrink when no two rows share an image) against HF's whole `generate`.

Usage: python -m bench.images [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from .common import OUT, columns, environment, in_process, peak_rss_mib, run_batchrun, save

MODULE = "bench.images"
TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, head_dim=64)
VISION = dict(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, patch_size=14
)
IMAGE_SIZE = 112  # 8 x 8 patches: 64 image tokens a picture
QUESTIONS = [
    "Describe this image.",
    "What shape is this, and what colour?",
    "Caption this picture in one line.",
]


def build(work: Path, rows: int) -> Path:
    """The model and `rows` pictures with their questions (work/prompts.parquet: id, prompt, image)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw

    from batchrun.model_loader import resolve_model_dir
    from jobs.make_caption_data import make_model

    rng = random.Random(0)
    (work / "images").mkdir(parents=True, exist_ok=True)
    table = []
    for i in range(rows):
        image = Image.new("RGB", (160, 120), tuple(rng.randrange(200, 256) for _ in range(3)))
        x, y, r = rng.randrange(20, 140), rng.randrange(20, 100), rng.randrange(8, 20)
        ImageDraw.Draw(image).ellipse(
            (x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3))
        )
        name = f"images/{i:03d}.png"
        image.save(work / name)
        table.append({"id": i, "prompt": QUESTIONS[i % len(QUESTIONS)], "image": name})
    pq.write_table(pa.Table.from_pylist(table), work / "prompts.parquet")
    return make_model(work / "model", resolve_model_dir(None), TEXT, VISION, IMAGE_SIZE)


def batchrun_run(work: str, label: str, model: str, new: int) -> dict:
    sections = {
        "model": {"path": model, "dtype": "float32"},
        "input": {"image_column": "image"},
        "sampling": {"max_new_tokens": new, "ignore_eos": True},
    }  # the engine's defaults, as a job gets them (max_num_seqs 256: every row at once here)
    r = run_batchrun(Path(work), label, sections)
    return {k: v for k, v in r.items() if k not in ("prompt_ids", "completions")}


def hf_run(work: str, label: str, model: str, new: int, batch: int, prefill_only: bool = False) -> dict:
    """HF `generate`, fp32, greedy, left-padded batches (`min_new_tokens` = max: every row generates `new`
    tokens, as batchrun's ignore_eos). `prefill_only`: the same batches' forward over their prompts alone
    (`wall_s` is then that forward's time)."""
    import pyarrow.parquet as pq
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(os.cpu_count() or 1)
    rows = pq.read_table(Path(work) / "prompts.parquet").to_pylist()
    processor = AutoProcessor.from_pretrained(model)
    processor.tokenizer.padding_side = "left"
    lm = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    t1 = time.perf_counter()
    pad = processor.tokenizer.pad_token_id or processor.tokenizer.eos_token_id
    prompt_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(rows), batch):
            part = rows[i : i + batch]
            texts = [
                processor.apply_chat_template(
                    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["prompt"]}]}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                for r in part
            ]
            images = [Image.open(Path(work) / r["image"]).convert("RGB") for r in part]
            enc = processor(text=texts, images=images, return_tensors="pt", padding=True)
            prompt_tokens += int(enc["attention_mask"].sum())
            if prefill_only:
                lm(**enc, logits_to_keep=1)
            else:
                lm.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    end = time.perf_counter()
    generated = 0 if prefill_only else new * len(rows)
    return dict(
        label=label,
        rows=len(rows),
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        wall_s=end - t1,
        tokens_per_s=generated / (end - t1),
        peak_rss_mib=peak_rss_mib(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32 rows, 8 new tokens (a smoke run)")
    ap.add_argument("--out", default=str(OUT / "images.json"))
    args = ap.parse_args()
    rows, new = (32, 8) if args.quick else (200, 32)
    work = OUT / "images"
    model = str(build(work, rows))
    r: dict = {**environment(), "quick": args.quick, "rows": rows, "new": new}
    print(f"images: {rows} rows, a distinct {IMAGE_SIZE}px picture each, {new} new tokens")
    runs = []
    for function, label, extra in (
        ("batchrun_run", "batchrun", {}),
        ("hf_run", "hf-generate-16", {"batch": 16}),
    ):
        t0 = time.perf_counter()  # the whole process, from outside: Python's start, imports, load, the rows
        x = in_process(MODULE, function, work=str(work), label=label, model=model, new=new, **extra)
        x["process_s"] = time.perf_counter() - t0
        runs.append(x)
    ours, theirs = runs
    prefill = in_process(MODULE, "hf_run", work=str(work), label="hf-prefill-16", model=model, new=new, batch=16,
                         prefill_only=True)  # fmt: skip
    r["hf_prefill"] = prefill
    for x in (ours, theirs):
        x["process_tokens_per_s"] = x["generated_tokens"] / x["process_s"]
        x["images_per_s"] = rows / x["process_s"]
    phases = sum(v for k, v in ours.items() if k.startswith("time_") and k != "time_attention_s")
    r["encoder_share"] = ours["time_encode_s"] / phases if phases else 0.0
    r.update(batchrun=ours, hf=theirs)
    lines = [
        f"\n== image prompts (LLaVA shape: CLIP {VISION['num_hidden_layers']} layers, Llama "
        f"{TEXT['num_hidden_layers']} layers) vs HF generate, {r['date']}, {r['cpu']}, {r['cpus']} CPUs"
        f"{' (quick)' * args.quick} =="
    ]
    spec = {
        "run": "{label}",
        "generated tok/s": "{tokens_per_s:.1f}",
        "whole process tok/s": "{process_tokens_per_s:.1f}",
        "images/s (whole process)": "{images_per_s:.2f}",
        "process s": "{process_s:.1f}",
        "peak RSS MiB": "{peak_rss_mib:.0f}",
    }
    lines += ["", *columns(spec, [ours, theirs])]
    lines.append(
        f"batchrun / HF generate, whole process: **{ours['process_tokens_per_s'] / theirs['process_tokens_per_s']:.2f}x**; "
        f"generation alone: **{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x**"
    )
    lines.append(
        f"image encoder: {ours['images_encoded']} images encoded, {ours['image_tokens']} image tokens, "
        f"{ours['time_encode_s']:.2f} s = **{r['encoder_share']:.1%}** of the steps' time"
    )
    bound = theirs["wall_s"] / prefill["wall_s"]
    lines.append(
        f"HF's forward over the same batches' prompts alone ({prefill['prompt_tokens']} prompt tokens, image "
        f"encoder included): {prefill['wall_s']:.2f} s of its generate's {theirs['wall_s']:.2f} s, so an engine "
        f"that computes the prompts as HF does generates at most **{bound:.2f}x** HF's speed (generation alone); "
        f"batchrun's forward took {ours.get('time_forward_s', 0.0):.2f} s of its {ours['wall_s']:.2f} s"
    )
    save(r, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"batchrun_run": batchrun_run, "hf_run": hf_run}):
        main()
