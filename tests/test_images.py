"""Images in prompts (engine/model/multimodal.py, images.py): a tiny random-weight LLaVA (a CLIP vision tower, a Llama
language model, the embedded model's tokenizer with an image token) saved as a model directory with its
processor, against HF `generate` (processor + model, one conversation at a time, greedy fp32)."""

from __future__ import annotations

import base64
import copy
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    paged_model_from_config,
    read_outputs,
    run_cli,
    save_vlm,
    start_submit,
    wait_for_parts,
    write_job,
)

from batchrun import LLM, SamplingParams

NEW_TOKENS = 12
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def caption_data(tmp_path_factory):
    """jobs/make_caption_data.py's output: a few images, their caption requests and a tiny LLaVA model
    directory (weights, config, tokenizer and processor with a PIL image processor)."""
    out = tmp_path_factory.mktemp("caption")
    script = ROOT / "jobs" / "make_caption_data.py"
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--images", "6"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return out


@pytest.fixture(scope="module")
def llava_dir(caption_data):
    return caption_data / "model"


@pytest.fixture(scope="module")
def reference(llava_dir):
    """HF's processor and model (eager attention) of the directory."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, attn_implementation="eager").eval()
    return AutoProcessor.from_pretrained(llava_dir), model


def picture(seed: int, height: int = 40, width: int = 50):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_generate(reference, content: list, images: list) -> list[int]:
    processor, model = reference
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    enc = processor(text=text, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def submit(tmp_path, llava_dir, name: str, input_section: str, output_extra: str = "") -> None:
    """A job of the tiny LLaVA on `input_section` (the job file's `input:` mapping, inside braces), written to
    tmp_path/out; asserts it exits 0."""
    job = write_job(
        tmp_path / "job.yaml",
        f"""
name: {name}
model: {{path: {llava_dir}, dtype: float32}}
input: {{{input_section}}}
output: {{path: {tmp_path / "out"}{output_extra}}}
engine: {{device: cpu, num_pages: 64}}
sampling: {{max_new_tokens: {NEW_TOKENS}}}
""",
    )
    r = run_cli("submit", str(job))
    assert r.returncode == 0, r.stderr


def conversations(tmp_path):
    """One image (a PIL image), two images (a data: URL and a path), no image, and the first image again."""
    a, b, c = picture(0), picture(1, 47), picture(2, 54, 30)
    c.save(tmp_path / "c.png")
    ours = [
        [{"type": "image", "image": a}, {"type": "text", "text": "Describe this."}],
        [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": data_url(b)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": str(tmp_path / "c.png")}},
        ],
        [{"type": "text", "text": "No image here, just text."}],
        [{"type": "image", "image": a}, {"type": "text", "text": "Describe it at length, please."}],
    ]
    theirs = [
        ([{"type": "image"}, {"type": "text", "text": "Describe this."}], [a]),
        (
            [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ],
            [b, c],
        ),
        ([{"type": "text", "text": "No image here, just text."}], []),
        ([{"type": "image"}, {"type": "text", "text": "Describe it at length, please."}], [a]),
    ]
    return [[{"role": "user", "content": parts}] for parts in ours], theirs


@pytest.mark.parametrize(
    "engine",
    [
        dict(),  # every prompt whole
        dict(max_num_batched_tokens=16),  # prompts in chunks that cut through the images' 16 tokens
        dict(max_num_batched_tokens=16, num_pages=6, preemption="recompute"),  # and preempted
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_image_prompts_equal_hf_generate(llava_dir, reference, tmp_path, engine):
    convs, theirs = conversations(tmp_path)
    expected = [hf_generate(reference, content, images) for content, images in theirs]
    llm = LLM(model=str(llava_dir), dtype="float32", device="cpu", **{"num_pages": 256, **engine})
    outs = llm.chat(convs, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    encoder = llm.engine.encoder
    assert encoder.image_tokens == 16 * 4 and not encoder.held  # features dropped once their tokens are in
    if "num_pages" in engine:
        assert any(o.outputs[0].num_preemptions for o in outs)


def test_the_comparison_sees_a_missing_image(llava_dir, reference, tmp_path, monkeypatch):
    """The test can fail: with the image features zeroed (no merge), the image rows differ from HF."""
    from batchrun.engine.model import multimodal

    convs, theirs = conversations(tmp_path)
    expected = hf_generate(reference, *theirs[0])
    real = multimodal._feature_rows
    monkeypatch.setattr(
        multimodal, "_feature_rows", lambda out, h: [torch.zeros_like(r) for r in real(out, h)]
    )
    llm = LLM(model=str(llava_dir), dtype="float32", device="cpu", num_pages=64)
    out = llm.chat(convs[0], SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert out[0].outputs[0].token_ids != expected


def test_prefix_sharing_keys_image_pages_by_the_image(llava_dir, reference):
    """Rows with one system prompt and an image: a row with the same image reuses its image's pages, a row with
    another image (the same placeholder tokens) shares only the text before it; each equals HF."""
    a, b = picture(5), picture(6)
    system = "You describe pictures for a catalogue. " * 4
    rows = [(a, "Colours?"), (a, "Shapes?"), (b, "Colours?")]
    llm = LLM(model=str(llava_dir), dtype="float32", device="cpu", num_pages=128, max_num_seqs=1)
    cache = llm.engine.block_manager.prefix_cache
    hits = []
    for image, question in rows:
        before = cache.hit_tokens
        conv = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": question}],
            },
        ]
        out = llm.chat(conv, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
        hits.append(cache.hit_tokens - before)
        processor, model = reference
        text = processor.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        enc = processor(text=text, images=[image], return_tensors="pt")
        with torch.inference_mode():
            ref = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0].outputs[0].token_ids == ref[0, enc["input_ids"].shape[1] :].tolist()
        first_image = enc["input_ids"][0].tolist().index(llm.engine.plan.image_token_id)
    assert hits[0] == 0
    assert hits[1] > first_image  # past the image's first token: its pages were shared
    assert 0 < hits[2] <= first_image  # the text before it only


def test_a_job_with_image_parts_and_a_bad_image_row(llava_dir, reference, tmp_path):
    """A Parquet job of conversations with image_url parts (a path relative to the input, a data: URL): rows
    equal HF; a missing image is that row's error naming the turn and part, and the job goes on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = picture(7)
    a.save(tmp_path / "a.png")

    def conv(url):
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "text": None, "image_url": {"url": url}},
                    {"type": "text", "text": "Describe.", "image_url": None},
                ],
            }
        ]

    pq.write_table(
        pa.table({"id": ["p", "d", "x"], "prompt": [conv("a.png"), conv(data_url(a)), conv("missing.png")]}),
        tmp_path / "in.parquet",
    )
    submit(
        tmp_path,
        llava_dir,
        "caption",
        f"parquet: {tmp_path / 'in.parquet'}, id_column: id",
        ", token_ids: true",
    )
    got = read_outputs(tmp_path / "out")
    expected = hf_generate(reference, [{"type": "image"}, {"type": "text", "text": "Describe."}], [a])
    for key in ("p", "d"):
        assert got[(key, 0)]["error"] is None and got[(key, 0)]["completion_token_ids"] == expected
    assert got[("x", 0)]["finish_reason"] == "error"
    assert "turn 1, content part 1" in got[("x", 0)]["error"] and "missing.png" in got[("x", 0)]["error"]


@pytest.mark.parametrize("family", ["paligemma", "glm4v"])
def test_images_the_engine_cannot_compute_are_refused(family):
    """A model whose prompt attends to later tokens (PaliGemma's prefix) or whose image tokens take 3-D positions
    of its own (GLM-4V), on a family batchrun has no rule for, takes no images: the reason says which."""
    from transformers import AutoConfig

    from batchrun.engine.model.multimodal import images_unsupported_reason

    cfg = AutoConfig.for_model(family)
    text = cfg.get_text_config()
    for key, value in dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=300,
    ).items():  # fmt: skip
        setattr(text, key, value)
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    vision = cfg.vision_config
    for key, value in dict(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
        out_hidden_size=64, embed_dim=32, image_size=32,
    ).items():  # fmt: skip
        if hasattr(vision, key):
            setattr(vision, key, value)
    model = paged_model_from_config(copy.deepcopy(cfg))
    reason = images_unsupported_reason(model)
    assert reason and ("later ones" if family == "paligemma" else "3-D rotary") in reason, reason


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory, model_dir, llava_dir):
    """A tiny Idefics3 (SmolVLM's and Granite Docling's architecture): images split into tiles plus a global
    view, a pixel-shuffle connector; its processor gives one prompt's images as one tensor of tiles."""
    from model_families import TINY_VISION, tiny_text
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tok = AutoTokenizer.from_pretrained(model_dir)
    extra = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": extra})
    text = tiny_text(len(tok), model_type="llama")
    vision = dict(TINY_VISION, model_type="idefics3_vision", image_size=32, patch_size=8)
    cfg = AutoConfig.for_model(
        "idefics3",
        text_config=text,
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    target = tmp_path_factory.mktemp("idefics3")
    save_vlm(cfg, target)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    template = AutoProcessor.from_pretrained(llava_dir).chat_template  # places image parts as <image>
    Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=template
    ).save_pretrained(target)
    return target


@pytest.mark.parametrize("chunk", [4096, 24])
def test_idefics3_tiled_images_equal_hf_generate(idefics3_dir, chunk):
    """Two images (4 tiles and a global view each), one image, text alone; whole prompts and prompts in chunks
    of 24 tokens that cut through the tiles' tokens: equal to HF `generate`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(idefics3_dir)
    model = AutoModelForImageTextToText.from_pretrained(idefics3_dir, attn_implementation="eager").eval()
    a, b = picture(10), picture(11, 60, 30)
    cases = [
        (
            [
                {"type": "text", "text": "Look"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ],
            [a, b],
        ),
        ([{"type": "image"}, {"type": "text", "text": "What is it?"}], [b]),
        ([{"type": "text", "text": "Text alone."}], []),
    ]
    expected = []
    for content, images in cases:
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        enc = processor(text=text, images=[images] if images else None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, enc["input_ids"].shape[1] :].tolist())
    llm = LLM(
        model=str(idefics3_dir), dtype="float32", device="cpu", num_pages=128, max_num_batched_tokens=chunk
    )
    convs = []
    for content, images in cases:
        pictures = iter(images)
        parts = [{"type": "image", "image": next(pictures)} if p["type"] == "image" else p for p in content]
        convs.append([{"role": "user", "content": parts}])
    outs = llm.chat(convs, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_an_image_column_goes_before_the_prompt(llava_dir, reference, tmp_path):
    """`input.image_column`: a column of image bytes (an HF Image feature's {bytes, path} too) before each row's
    text prompt; a null image leaves a text prompt. Equal to HF `generate` on the same conversation."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = picture(20), picture(21, 30, 60)
    png = lambda im: base64.b64decode(data_url(im).split(",", 1)[1])  # noqa: E731
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "none"],
                "prompt": ["Caption it.", "What colour?", "No picture."],
                "image": [{"bytes": png(a), "path": None}, {"bytes": png(b), "path": None}, None],
            }
        ),
        tmp_path / "in.parquet",
    )
    submit(
        tmp_path,
        llava_dir,
        "caption-column",
        f"parquet: {tmp_path / 'in.parquet'}, id_column: id, image_column: image",
        ", token_ids: true",
    )
    got = read_outputs(tmp_path / "out")
    for key, image, text in (("a", a, "Caption it."), ("b", b, "What colour?")):
        expected = hf_generate(reference, [{"type": "image"}, {"type": "text", "text": text}], [image])
        assert got[(key, 0)]["completion_token_ids"] == expected, key
    assert got[("none", 0)]["completion_token_ids"] == hf_generate(
        reference, [{"type": "text", "text": "No picture."}], []
    )


def test_an_openai_batch_file_with_image_parts(llava_dir, reference, tmp_path):
    """OpenAI Batch API lines with image_url parts (a data: URL, a path relative to the file): each answer
    equals HF `generate`; a line whose image is not an image is an error line, and the others go on. vLLM's
    {type: image_pil} form of a part is taken from Python."""
    import json

    a, b = picture(30), picture(31, 50, 40)
    b.save(tmp_path / "b.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")

    def line(cid, url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
        body = {"model": "base", "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    (tmp_path / "batch.jsonl").write_text(
        "\n".join([line("a", data_url(a)), line("b", "b.png"), line("bad", "bad.png")]) + "\n"
    )
    submit(tmp_path, llava_dir, "caption-batch", f"openai_batch: {tmp_path / 'batch.jsonl'}")
    lines = {}
    for part in sorted((tmp_path / "out").glob("part-*.jsonl")):
        for text in part.read_text().splitlines():
            entry = json.loads(text)
            lines[entry["custom_id"]] = entry
    processor, _ = reference
    for cid, image in (("a", a), ("b", b)):
        expected = hf_generate(reference, [{"type": "image"}, {"type": "text", "text": "Describe."}], [image])
        answer = lines[cid]["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == processor.tokenizer.decode(expected, skip_special_tokens=True), cid
    assert lines["bad"]["response"] is None and "content part 1" in lines["bad"]["error"]["message"]
    llm = LLM(model=str(llava_dir), dtype="float32", device="cpu", num_pages=64)
    conv = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "Describe."}],
        }
    ]
    out = llm.chat(conv, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_generate(
        reference, [{"type": "image"}, {"type": "text", "text": "Describe."}], [a]
    )


def test_image_features_wait_within_their_budget(llava_dir, reference, tmp_path):
    """Twelve image prompts in steps of 40 tokens: the features waiting for prefill never pass the encoder's
    budget (max_num_batched_tokens image tokens) but for a prompt alone that needs more, and the rows equal HF;
    without the budget the same job holds more at once (the check can fail)."""
    from batchrun.engine.model import multimodal

    convs, theirs = conversations(tmp_path)
    expected = [hf_generate(reference, content, images) for content, images in theirs]

    def run():
        llm = LLM(
            model=str(llava_dir), dtype="float32", device="cpu", num_pages=256, max_num_batched_tokens=40
        )
        outs = llm.chat(convs * 3, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected * 3
        summary = llm.engine.image_counts()
        per_token = summary["encoder_budget_bytes"] // 40
        prompts = [llm.encode_chat(c) for c in convs]
        largest = max(len(p.images.positions) for p in prompts if p.images is not None)
        return summary["encoder_peak_bytes"], max(40, largest) * per_token

    peak, bound = run()
    assert 0 < peak <= bound
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multimodal.EncoderCache, "fit", lambda self, seq, start, n: n)
        unbounded, _ = run()
    assert unbounded > bound


def test_the_ray_data_processor_takes_an_image_column(llava_dir, reference, tmp_path):
    """The Ray Data processor (called on a batch as Ray Data calls it) reads the job's image column from the
    batch: each row equals HF `generate` on the image before its prompt, and a batch without the column is
    refused naming it."""
    import asyncio

    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun.ray import Processor

    a, b = picture(40), picture(41, 30, 60)
    png = lambda im: base64.b64decode(data_url(im).split(",", 1)[1])  # noqa: E731
    batch = pa.table({"id": ["a", "b"], "prompt": ["Caption it.", "What colour?"], "image": [png(a), png(b)]})
    pq.write_table(batch, tmp_path / "in.parquet")
    job = write_job(
        tmp_path / "job.yaml",
        f"""
name: ray-images
model: {{path: {llava_dir}, dtype: float32}}
input: {{parquet: {tmp_path / "in.parquet"}, id_column: id, image_column: image}}
output: {{path: {tmp_path / "out"}, token_ids: true}}
engine: {{device: cpu, num_pages: 64}}
sampling: {{max_new_tokens: {NEW_TOKENS}}}
""",
    )
    processor = Processor(str(job))
    rows = asyncio.run(processor(batch)).to_pylist()
    for row, image, text in zip(rows, (a, b), ("Caption it.", "What colour?"), strict=True):
        expected = hf_generate(reference, [{"type": "image"}, {"type": "text", "text": text}], [image])
        assert row["error"] is None and row["completion_token_ids"] == expected, row["id"]
    with pytest.raises(ValueError, match="no column 'image'"):
        asyncio.run(processor(batch.drop_columns(["image"])))


def test_an_image_job_killed_and_resumed_writes_every_row_once(caption_data, tmp_path):
    """jobs/make_caption_data.py's image rows (paths relative to the Parquet file), one row a part: killed with
    SIGKILL after two parts, then resumed, every row is there once and equal to an uninterrupted run."""
    import signal

    job = write_job(
        tmp_path / "job.yaml",
        f"""
name: caption-resume
model: {{path: {caption_data / "model"}, dtype: float32}}
input: {{parquet: {caption_data / "captions.parquet"}, image_column: image, id_column: id}}
output: {{path: {tmp_path / "ref"}, rows_per_part: 1, flush_seconds: 0}}
engine: {{device: cpu, num_pages: 64, max_num_seqs: 1}}
sampling: {{max_new_tokens: 48, ignore_eos: true}}
""",
    )  # rows of 48 tokens one at a time: time to see two parts and kill before the last
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    reference = {k: v["completion"] for k, v in read_outputs(tmp_path / "ref").items()}
    out = tmp_path / "killed"
    proc = start_submit(job, out)
    assert wait_for_parts(out, 2, proc), "the run ended before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 0 < len(list(out.glob("part-*.parquet"))) < len(reference)
    r = run_cli("submit", str(job), "--quiet", "--set", f"output.path={out}")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(out)  # asserts no (id, sample) twice
    assert {k: v["completion"] for k, v in rows.items()} == reference and len(reference) == 6


def test_generate_takes_vllms_multi_modal_data(llava_dir, reference):
    """Issue 43, item 1: vLLM's {"prompt": text holding the image placeholders, "multi_modal_data": {"image":
    one image or a list}} runs as the same conversation's image parts do (equal to HF generate)."""
    processor, _ = reference
    a, b, c = picture(0), picture(1, 47), picture(2, 54, 30)
    contents = [
        [{"type": "image"}, {"type": "text", "text": "Describe this."}],
        [
            {"type": "text", "text": "Compare"},
            {"type": "image"},
            {"type": "text", "text": "and"},
            {"type": "image"},
        ],
    ]
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": x}], add_generation_prompt=True, tokenize=False
        )
        for x in contents
    ]
    llm = LLM(model=str(llava_dir), dtype="float32", device="cpu", num_pages=256)
    prompts = [
        {"prompt": texts[0], "multi_modal_data": {"image": a}},
        {"prompt": texts[1], "multi_modal_data": {"image": [b, c]}},
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    expected = [hf_generate(reference, contents[0], [a]), hf_generate(reference, contents[1], [b, c])]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].prompt == texts[0]
    with pytest.raises(ValueError, match=r'prompts\[0\]\["multi_modal_data"\]: expected \{"image"'):
        llm.generate([{"prompt": texts[0], "multi_modal_data": {"video": a}}], use_tqdm=False)
